"""Saves that finish in the background: one at a time, each with a handle.

The checkpoint thread and the pending save are process state
(:mod:`mpar.comm._process_state`): ``mpar.shutdown`` waits for the save (warning,
not raising, if it failed) and ends the thread.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from mpar.checkpoint._common import CheckpointError
from mpar.comm import _process_state

__all__ = ["CheckpointHandle", "finished", "pending", "submit", "wait_checkpoint"]

_EXECUTOR: ThreadPoolExecutor | None = None
"""The checkpoint thread, started by the first asynchronous save."""
_PENDING: CheckpointHandle | None = None
"""The latest save not waited for yet."""


class CheckpointHandle:
    """A checkpoint being written (``async_save=True``) or written.

    ``wait()`` (alias ``result()``) blocks until every rank's shards are on disk
    and the checkpoint is committed, and returns its directory; it raises the
    save's :class:`~mpar.checkpoint.CheckpointError` if it failed.
    """

    def __init__(self, future: Future[Path], path: Path) -> None:
        self._future = future
        self.path = path
        """The directory the checkpoint has once committed."""
        self._reported = False

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save to be committed; returns its directory."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                self._reported = True

    result = wait

    def __repr__(self) -> str:
        status = "done" if self.done() else "writing"
        return f"CheckpointHandle({str(self.path)!r}, {status})"


def submit(job: Callable[[], Path], path: Path) -> CheckpointHandle:
    """Run ``job`` in the checkpoint thread; it becomes the pending save."""
    global _EXECUTOR, _PENDING
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpar-checkpoint")
    _PENDING = CheckpointHandle(_EXECUTOR.submit(job), path)
    return _PENDING


def finished(job: Callable[[], Path], path: Path) -> CheckpointHandle:
    """Run ``job`` now; a handle that is already done."""
    future: Future[Path] = Future()
    future.set_result(job())
    return CheckpointHandle(future, path)


def pending() -> CheckpointHandle | None:
    return _PENDING


def wait_checkpoint() -> Path | None:
    """Wait for the pending asynchronous save, if any; returns its directory.

    Raises its error unless ``handle.wait()`` already did. Every rank calls it
    (``save_checkpoint``, ``load_checkpoint`` and ``mpar.shutdown`` do).
    """
    global _PENDING
    handle, _PENDING = _PENDING, None
    if handle is None:
        return None
    if handle._reported:
        return handle.path if handle._future.exception() is None else None
    return handle.wait()


def _finish() -> None:
    """At ``shutdown``: finish a pending save (report, not raise, its failure) and end
    the checkpoint thread."""
    global _EXECUTOR
    try:
        wait_checkpoint()
    except CheckpointError as exc:
        warnings.warn(f"the last asynchronous checkpoint failed: {exc}", stacklevel=2)
    executor, _EXECUTOR = _EXECUTOR, None
    if executor is not None:
        executor.shutdown(wait=True)


_process_state.register(
    "mpar.checkpoint._async", _finish, lambda: _EXECUTOR is None and _PENDING is None
)
