"""What one rank says about itself when asked: its position, flight recorder and stacks.

Everything here runs in the watchdog thread while the main thread may be
blocked or busy: it reads :data:`~mpar.comm._progress.PROGRESS` and
``sys._current_frames()`` (a rank asleep in its main thread still answers) and
returns JSON-able dicts; :func:`write_trace` puts them into the ``trace`` folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from mpar.comm._hang import position
from mpar.comm._progress import PROGRESS, describe_wait
from mpar.comm._types import ProcessGroup, Wait

__all__ = ["flight_record", "snapshot", "thread_stacks", "wait_info", "write_trace"]

_LAUNCH_ENTRY = os.path.join("mpar", "launch", "_bootstrap.py")
"""``mpar launch``'s child entry, which runs the user's script: its frames are left out."""


def wait_info(what: Wait, since: float, me: int) -> dict[str, Any]:
    """A wait of :class:`~mpar.comm._progress.Waiting` with its peers resolved to global
    ranks (``peers``: the ones this rank waits for; ``peers_all``: the whole group)."""
    kind, peer, detail = what
    if kind == "collective":
        group_ranks = list(range(dist.get_world_size())) if detail is None else None
        if group_ranks is None and isinstance(detail, ProcessGroup):
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


def _user_frames(frame: FrameType) -> traceback.StackSummary:
    """The stack of ``frame``, without the launcher's frames above the user's script."""
    summary = traceback.extract_stack(frame)
    skip = 0
    for skip, entry in enumerate(summary):  # noqa: B007 - the index is the result
        name = entry.filename
        if not (name.endswith(("runpy.py", _LAUNCH_ENTRY)) or name == "<frozen runpy>"):
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


def _torch_call(frame: FrameType | None) -> str | None:
    """The ``torch.distributed`` function the main thread is inside, if any."""
    found = None
    while frame is not None:
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            found = frame.f_code.co_name  # keep going: the outermost one is the user's call
        frame = frame.f_back
    return None if found is None else f"torch.distributed.{found}"


def _event_text(kind: str, what: object) -> str:
    if kind == "action":
        return str(what)
    if kind == "collective" and isinstance(what, tuple):
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
        "wait": None if wait is None else wait_info(wait, since, rank),
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
