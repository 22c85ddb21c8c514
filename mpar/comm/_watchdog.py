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
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mpar.comm import _abort
from mpar.comm._hang import diagnose, format_report, position
from mpar.comm._progress import PROGRESS, describe_wait
from mpar.launch._bootstrap import BOOTSTRAP_PATH, HANG_REPORTED_ENV, record_failure

__all__ = [
    "QUIET_ENV",
    "exit_if_reported",
    "flight_record",
    "start",
    "stop",
    "transport_timeout",
    "write_trace",
]

QUIET_ENV = HANG_REPORTED_ENV
"""Set in a rank's environment once a hang verdict is out: its own later errors
(connections closed by the exiting ranks) are consequences, not news."""
_POLL_S = 0.25
_ANSWER_WINDOW_S = 5.0
_EXIT_WAIT_S = 5.0
_TRANSPORT_MARGIN_S = 60.0
_generation = 0
_stop = threading.Event()
_thread: threading.Thread | None = None


def transport_timeout(timeout_s: float) -> datetime.timedelta:
    """The process groups' own timeout: past the watchdog's deadline and its report."""
    return datetime.timedelta(seconds=timeout_s + _TRANSPORT_MARGIN_S)


# -- what this rank says about itself ------------------------------------------------


def _wait_info(what: tuple[str, Any, Any], since: float, me: int) -> dict[str, Any]:
    kind, peer, detail = what
    if kind == "collective":
        group_ranks = list(range(dist.get_world_size())) if detail is None else None
        if group_ranks is None:
            with contextlib.suppress(Exception):
                group_ranks = list(dist.get_process_group_ranks(detail))
        members = group_ranks or []
        return {
            "kind": kind,
            "name": peer,
            "text": describe_wait(what, group_ranks),
            "peers": [r for r in members if r != me],
            "peers_all": members,
            "since": since,
        }
    return {
        "kind": kind,
        "name": None,
        "text": describe_wait(what),
        "peers": [int(peer)],
        "peers_all": [int(peer)],
        "since": since,
    }


def _user_frames(frame: Any) -> traceback.StackSummary:
    """The stack of ``frame``, without the launcher's frames above the user's script."""
    summary = traceback.extract_stack(frame)
    skip = 0
    for skip, entry in enumerate(summary):  # noqa: B007 - the index is the result
        name = entry.filename
        if not (name.endswith("runpy.py") or name in ("<frozen runpy>", BOOTSTRAP_PATH)):
            break
    return traceback.StackSummary.from_list(summary[skip:])


def thread_stacks() -> tuple[str, str]:
    """(every thread's stack, the main thread's), most recent call last; mpar's threads left out."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    texts, main = [], ""
    for ident in sorted(frames, key=lambda i: (i != main_id, i)):
        thread = threads.get(ident)
        name = thread.name if thread is not None else f"0x{ident:x}"
        if name.startswith("mpar-"):
            continue
        body = "".join(_user_frames(frames[ident]).format())
        text = f"Thread {name} (most recent call last):\n{body}"
        texts.append(text)
        if ident == main_id:
            main = text
    return "\n".join(texts), main


def _torch_call(frame: Any) -> str | None:
    """The ``torch.distributed`` function the main thread is inside, if any."""
    found = None
    while frame is not None:
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            found = frame.f_code.co_name  # keep going: the outermost one is the user's call
        frame = frame.f_back
    return None if found is None else f"torch.distributed.{found}"


def _event_text(kind: str, what: Any) -> str:
    if kind == "action":
        return str(what)
    if kind == "collective":
        return describe_wait(what)
    return {"step": "step begins", "end": "step ends", "raised": "step raised"}.get(kind, kind)


def snapshot(rank: int) -> dict[str, Any]:
    """This rank's position, flight recorder and stacks (JSON-able)."""
    wait, since = PROGRESS.wait, PROGRESS.since
    stacks, main = thread_stacks()
    return {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.time(),
        "step": PROGRESS.step,
        "in_step": PROGRESS.in_step,
        "action": None if PROGRESS.action is None else str(PROGRESS.action),
        "last": PROGRESS.last,
        "wait": None if wait is None else _wait_info(wait, since, rank),
        "inside": _torch_call(sys._current_frames().get(threading.main_thread().ident or 0)),
        "recent": [[t, s, _event_text(k, w)] for t, s, k, w in PROGRESS.recent()],
        "stacks": stacks,
        "main_stack": main,
    }


def flight_record(rank: int) -> dict[str, Any]:
    """This rank's flight recorder as written to the trace directory."""
    snap = snapshot(rank)
    return {
        "rank": rank,
        "pid": snap["pid"],
        "host": snap["host"],
        "position": position(snap),
        "events": [{"time": t, "step": s, "event": e} for t, s, e in snap["recent"]],
        "stacks": snap["stacks"],
    }


def write_trace(trace: str | None, rank: int, report: str | None = None) -> None:
    """With ``trace``, write this rank's flight recorder (and the report) there; never raises."""
    if not trace:
        return
    with contextlib.suppress(Exception):
        folder = Path(trace)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.flight.json").write_text(json.dumps(flight_record(rank), indent=1))
        if report is not None:
            (folder / "hang-report.txt").write_text(report)


# -- the store protocol ----------------------------------------------------------------


class _Watchdog:
    """One rank's side of the protocol (runs in the watchdog thread)."""

    def __init__(
        self, store: dist.Store, rank: int, world: int, timeout_s: float, trace: str | None
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s, self.trace = timeout_s, trace
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"mpar/hang/{restart}/{_generation}"
        self.answered = False

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def has(self, name: str) -> bool:
        return bool(self.store.check([self.key(name)]))

    def get(self, name: str) -> Any:
        return json.loads(self.store.get(self.key(name)).decode())

    def put(self, name: str, value: Any) -> None:
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

    def coordinate(self, wait: tuple[str, Any, Any], since: float) -> None:
        request = {"rank": self.rank, "wait": _wait_info(wait, since, self.rank)}
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
        """End this process. Every rank goes quiet (its later errors are consequences);
        the writer reports once all are quiet; then all leave, rank 0 last when it
        hosts the store (MPI, a plain ``MASTER_PORT``; not torchrun's agent)."""
        os.environ[QUIET_ENV] = "1"
        _abort.silence()
        self.put(f"seen/{self.rank}", 1)
        writer = verdict["writer"] == self.rank
        write_trace(self.trace, self.rank, verdict["report"] if writer else None)
        if writer:
            _report(verdict["message"], verdict["report"])
            self.put("written", 1)
            self.wait_until(lambda: self.everyone("seen"))  # all quiet before we leave
        else:
            sys.stderr.write(
                f"mpar: rank {self.rank} stops: rank {verdict['writer']} reports a hang\n"
            )
            sys.stderr.flush()
            self.wait_until(lambda: self.has("written"))
        with contextlib.suppress(Exception):
            self.put(f"gone/{self.rank}", 1)
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            self.wait_until(lambda: self.everyone("gone"))
        os._exit(1)

    def everyone(self, name: str) -> bool:
        """Whether every other rank that answered has set ``name/<rank>``."""
        others = [r for r in range(self.world) if r != self.rank]
        return all(self.has(f"{name}/{r}") or not self.has(f"snap/{r}") for r in others)

    @staticmethod
    def wait_until(done: Any) -> None:
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
    if os.environ.get(QUIET_ENV) == "1":
        os._exit(1)


def _report(message: str, report: str) -> None:
    """Print the report and record it as this rank's failure (error file, --mpi run folder)."""
    record_failure(f"HangError: {message}", report)


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


def start(host: str, port: int, rank: int, world: int, timeout_s: float, trace: str | None) -> None:
    """Start this rank's watchdog thread (multi-process jobs only; best effort)."""
    global _thread, _generation
    _generation += 1
    _stop.clear()
    os.environ.pop(QUIET_ENV, None)
    try:
        store = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(30.0, _ANSWER_WINDOW_S * 2)),
            wait_for_workers=False,
        )
    except Exception:
        return
    dog = _Watchdog(store, rank, world, timeout_s, trace)
    _thread = threading.Thread(target=_run, args=(dog,), name="mpar-watchdog", daemon=True)
    _thread.start()


def stop() -> None:
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2 * _POLL_S + 1)
    _thread = None
