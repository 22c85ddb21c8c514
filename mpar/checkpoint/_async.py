"""Saves that finish in the background: one at a time, each with a handle."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

__all__ = ["CheckpointHandle", "finished", "pending", "submit", "wait_checkpoint"]

_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: CheckpointHandle | None = None


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
