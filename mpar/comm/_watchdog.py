"""The hang watchdog: a rank that waits too long makes the job end with one report.

Every rank of a multi-process job runs one daemon thread with its own client
of the job's TCP store (the side channel: it works while the process group is
blocked). Each poll it reads :data:`~mpar.comm._progress.PROGRESS`, which the
main thread keeps up to date for free. Then:

1. a rank that has waited for a peer longer than ``timeout_s`` asks, once per
   job: it wins an election (``add`` on a counter) and writes the request;
2. every rank answers with a snapshot: its position, its flight recorder and
   the Python stack of each of its threads (``sys._current_frames``: a rank
   asleep in its main thread still answers from this one);
3. the asking rank waits a few seconds for the answers, names the rank that is
   behind (:func:`mpar.comm._hang.diagnose`) and publishes the verdict;
4. the rank that is behind (or the asking rank, when it did not answer) prints
   the report, records it as its failure (the error file of torchrun / ``mpar
   launch``, the run folder of ``mpar launch --mpi``) and exits 1; the others
   exit 1 quietly once it has. With ``trace``, every rank also writes its
   flight recorder there, and the reporting rank the report.

The transfers' and collectives' own timeouts are :func:`transport_timeout`
(longer), so the report comes before any gloo timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from mpar._failure import record_failure
from mpar.comm import _abort
from mpar.comm._hang import diagnose, format_report
from mpar.comm._process_layout import Layout
from mpar.comm._progress import PROGRESS
from mpar.comm._snapshot import snapshot, wait_info, write_trace
from mpar.comm._types import Wait

__all__ = [
    "HANG_REPORTED",
    "exit_if_reported",
    "is_stopped",
    "start",
    "stop",
    "transport_timeout",
]

HANG_REPORTED = threading.Event()
"""Set once a hang verdict is out: this rank's own later errors (connections closed
by the exiting ranks) are consequences, not news. (``mpar launch``'s child entry
reads it too, to exit quietly.)"""
_POLL_S = 0.25
_ANSWER_WINDOW_S = 5.0
_EXIT_WAIT_S = 5.0
_TRANSPORT_MARGIN_S = 60.0
_stop = threading.Event()
_thread: threading.Thread | None = None


def transport_timeout(timeout_s: float) -> datetime.timedelta:
    """The process groups' own timeout: past the watchdog's deadline and its report."""
    return datetime.timedelta(seconds=timeout_s + _TRANSPORT_MARGIN_S)


# -- the store protocol ----------------------------------------------------------------


class _Watchdog:
    """One rank's side of the protocol (runs in the watchdog thread)."""

    def __init__(
        self,
        store: dist.Store,
        layout: Layout,
        timeout_s: float,
        trace: str | None,
        generation: int,
    ) -> None:
        self.store, self.layout = store, layout
        self.rank, self.world = layout.rank, layout.world_size
        self.timeout_s, self.trace = timeout_s, trace
        self.prefix = f"mpar/hang/{layout.restart}/{generation}"
        self.answered = False

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def has(self, name: str) -> bool:
        return bool(self.store.check([self.key(name)]))

    def get(self, name: str) -> Any:
        return json.loads(self.store.get(self.key(name)).decode())

    def put(self, name: str, value: object) -> None:
        self.store.set(self.key(name), json.dumps(value))

    def poll(self) -> None:
        wait = PROGRESS.wait
        if wait is not None and not self.answered:
            waited = time.time() - PROGRESS.since
            if waited > self.timeout_s and self.store.add(self.key("elect"), 1) == 1:
                self.coordinate(wait, PROGRESS.since)
                return
        if not self.answered and self.has("request"):
            self.put(f"snap/{self.rank}", snapshot(self.rank))
            self.answered = True
        if self.answered and self.has("verdict"):
            self.act(self.get("verdict"))

    def coordinate(self, wait: Wait, since: float) -> None:
        request = {"rank": self.rank, "wait": wait_info(wait, since, self.rank)}
        self.put("request", request)
        self.put(f"snap/{self.rank}", snapshot(self.rank))
        self.answered = True
        snaps = self.collect()
        verdict = diagnose(snaps, self.world, request)
        report = format_report(verdict, snaps, self.world, self.timeout_s)
        writer = verdict.culprit if verdict.culprit in snaps else self.rank
        self.put("verdict", {"writer": writer, "message": verdict.message, "report": report})
        self.act(self.get("verdict"))

    def collect(self) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + _ANSWER_WINDOW_S
        while time.monotonic() < deadline:
            if all(self.has(f"snap/{r}") for r in range(self.world)):
                break
            time.sleep(_POLL_S / 2)
        return {r: self.get(f"snap/{r}") for r in range(self.world) if self.has(f"snap/{r}")}

    def act(self, verdict: dict[str, Any]) -> None:
        """End this process. Every rank goes quiet (its later errors are consequences)
        and the writer reports. Then they leave in an order launchers read well: the
        writer first (torchrun names the first rank to fail), rank 0 last when it
        hosts the store (MPI, a plain ``MASTER_PORT``; not torchrun's agent)."""
        HANG_REPORTED.set()
        _abort.silence()
        self.put(f"seen/{self.rank}", 1)
        writer = int(verdict["writer"])
        write_trace(self.trace, self.rank, verdict["report"] if writer == self.rank else None)
        if writer == self.rank:
            _report(verdict["message"], verdict["report"], self.layout)
            self.put("written", 1)
            self.wait_until(lambda: self.everyone("seen"))  # all quiet before we leave
        else:
            sys.stderr.write(f"mpar: rank {self.rank} stops: rank {writer} reports a hang\n")
            sys.stderr.flush()
            self.wait_until(lambda: self.has("written"))
        host = None if self.layout.agent_store else 0
        if self.rank == host:
            self.wait_until(lambda: self.everyone("gone"))
        elif self.rank != writer and writer != host:
            self.wait_until(lambda: self.has(f"gone/{writer}"))
        with contextlib.suppress(Exception):
            self.put(f"gone/{self.rank}", 1)
        _abort.exit_now()

    def everyone(self, name: str) -> bool:
        """Whether every other rank that answered has set ``name/<rank>``."""
        others = [r for r in range(self.world) if r != self.rank]
        return all(self.has(f"{name}/{r}") or not self.has(f"snap/{r}") for r in others)

    @staticmethod
    def wait_until(done: Callable[[], bool]) -> None:
        """Poll ``done()`` for a few seconds; a store that went away ends the wait."""
        deadline = time.monotonic() + _EXIT_WAIT_S
        try:
            while time.monotonic() < deadline and not done():
                time.sleep(_POLL_S / 5)
        except Exception:
            return


def exit_if_reported() -> None:
    """End this process now if a hang report is under way: an error in the main
    thread is then the report's consequence (a peer left), not news."""
    if HANG_REPORTED.is_set():
        _abort.exit_now()


def _report(message: str, report: str, layout: Layout) -> None:
    """Print the report and record it as this rank's failure (error file, --mpi run folder)."""
    record_failure(
        f"HangError: {message}",
        report,
        rank=layout.rank,
        error_file=layout.error_file,
        run_dir=layout.run_dir,
    )


def _run(dog: _Watchdog) -> None:
    failures = 0
    while not _stop.wait(_POLL_S):
        try:
            dog.poll()
            failures = 0
        except Exception:
            failures += 1  # the store went away: the job is ending
            if failures >= 8:
                return


def start(layout: Layout, timeout_s: float, trace: str | None, generation: int) -> None:
    """Start this rank's watchdog thread (multi-process jobs only; best effort).
    ``generation`` (the count of ``mpar.init`` calls) keeps each run's keys apart."""
    global _thread
    _stop.clear()
    HANG_REPORTED.clear()
    try:
        store = dist.TCPStore(
            layout.master_addr,
            layout.master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(30.0, _ANSWER_WINDOW_S * 2)),
            wait_for_workers=False,
        )
    except Exception:
        return
    dog = _Watchdog(store, layout, timeout_s, trace, generation)
    _thread = threading.Thread(target=_run, args=(dog,), name="mpar-watchdog", daemon=True)
    _thread.start()


def stop() -> None:
    """Stop the watchdog thread; once it has ended, forget this run (its events too).
    A thread still running is acting on a hang verdict: it ends the process."""
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2 * _POLL_S + 1)
        if _thread.is_alive():
            return
    _thread = None
    _stop.clear()
    HANG_REPORTED.clear()


def is_stopped() -> bool:
    """Whether no watchdog runs and nothing of a run is left (as at import)."""
    return _thread is None and not _stop.is_set() and not HANG_REPORTED.is_set()
