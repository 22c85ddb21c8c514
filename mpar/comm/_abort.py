"""Fail fast: a rank that fails tells the others, which stop instead of hanging.

A failing rank writes its traceback under one key of a TCP store. Every rank
runs a watcher thread with its own store client; when the key appears and
names another rank, the watcher prints that traceback and ends the process
(exit status 1), so the whole job stops within about a second instead of
waiting for the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist

from mpar.comm._shared import remove_created

__all__ = [
    "FAILED",
    "exit_now",
    "failure_published",
    "is_stopped",
    "publish_failure",
    "silence",
    "start_watcher",
    "stop_watcher",
]

_KEY = "mpar/failure"
_stop = threading.Event()
_quiet = threading.Event()
FAILED = threading.Event()
"""Set once this rank failed (an exception in a step, an uncaught exception, a
failure ``mpar launch``'s child entry recorded): ``shutdown`` then skips its final
barrier, since the peers will not come."""
_client: dist.TCPStore | None = None
_thread: threading.Thread | None = None
_published: str | None = None
"""The exception (last line of its traceback) this rank published first, if any."""
_POLL_S = 0.25


def _connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _watch(store: dist.TCPStore, rank: int) -> None:
    failures = 0
    while not _stop.wait(_POLL_S):
        try:
            if not store.check([_KEY]):
                failures = 0
                continue
            text = store.get(_KEY).decode(errors="replace")
        except Exception:
            failures += 1  # the store went away: the job is ending
            if failures >= 3:
                return
            continue
        source, _, body = text.partition("\n")
        if source == f"rank {rank}" or _stop.is_set():
            return
        if _quiet.is_set():  # a hang is being reported: that report says it all
            exit_now()
        sys.stderr.write(f"mpar: {source} failed; stopping rank {rank}. Its traceback:\n{body}\n")
        sys.stderr.flush()
        exit_now()


def exit_now() -> NoReturn:
    """End this process at once (status 1), after removing the shared-memory files it
    made (nothing else runs: no ``atexit``, no ``finally``)."""
    remove_created()
    os._exit(1)


def start_watcher(host: str, port: int, rank: int, timeout_s: float) -> None:
    """Start this rank's watcher thread (multi-process jobs only)."""
    global _client, _thread
    _stop.clear()
    _quiet.clear()
    FAILED.clear()
    try:
        _client = _connect(host, port, timeout_s)
        watcher_store = _connect(host, port, timeout_s)
    except Exception:
        _client = None
        return
    _thread = threading.Thread(
        target=_watch, args=(watcher_store, rank), name="mpar-abort-watcher", daemon=True
    )
    _thread.start()


def publish_failure(rank: int, traceback_text: str) -> None:
    """Tell every rank that this one failed (best effort; never raises)."""
    global _published
    FAILED.set()
    if _published is None:
        lines = traceback_text.strip().splitlines()
        _published = lines[-1] if lines else "an exception"
    if _client is None or _quiet.is_set():
        return
    with contextlib.suppress(Exception):
        _client.set(_KEY, f"rank {rank}\n{traceback_text}")


def failure_published() -> str | None:
    """The exception this rank published as its failure (the last line of its
    traceback), or None: its peers are stopping, so it must not transfer again."""
    return _published


def silence() -> None:
    """From now on this rank neither publishes its failures nor prints others' (the
    hang watchdog is ending the job with its own report)."""
    _quiet.set()


def stop_watcher() -> None:
    """Stop the watcher thread; once it has ended, forget this run (its events too).
    A thread still running is ending the process (another rank failed)."""
    global _client, _thread, _published
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2 * _POLL_S + 1)
        if _thread.is_alive():
            return
    _client, _thread, _published = None, None, None
    for event in (_stop, _quiet, FAILED):
        event.clear()


def is_stopped() -> bool:
    """Whether no watcher runs and nothing of a run is left (as at import)."""
    events = (_stop, _quiet, FAILED)
    return (
        _thread is None
        and _client is None
        and _published is None
        and not any(e.is_set() for e in events)
    )
