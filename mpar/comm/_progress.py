"""Where this rank is: its step, its action, what it waits for, and its recent past.

The main thread writes plain attributes of the one :data:`PROGRESS` object as it
goes (a few hundred nanoseconds per event, no lock, no I/O); the hang watchdog
(:mod:`mpar.comm._watchdog`) reads them from its own thread. Events are kept in
a ring of the last :data:`RECENT` entries: the *flight recorder*.

A wait is described by a small tuple (:data:`~mpar.comm._types.Wait`), formatted
only when a report is written:

* ``("recv", src, label)``: a pipeline transfer from global rank ``src``, with its
  :class:`~mpar.comm._types.TransferLabel`;
* ``("send", dst, None)``: sends to ``dst`` still in flight at the end of a step;
* ``("collective", name, group)``: a collective over ``group`` (None: every rank).
"""

from __future__ import annotations

import time

from mpar.comm._types import ProcessGroup, TransferLabel, Wait, Work

__all__ = [
    "PROGRESS",
    "RECENT",
    "Progress",
    "Waiting",
    "WatchedWork",
    "describe_label",
    "describe_wait",
    "watched",
]

Event = tuple[float, int, str, object]
"""A flight-recorder entry: (time, step, kind, what: an action, a wait or None)."""

RECENT = 64
"""Events the flight recorder keeps (more with the ``trace`` key)."""


class Progress:
    """This rank's position; written by the main thread, read by the watchdog."""

    __slots__ = ("action", "capacity", "count", "in_step", "last", "ring", "since", "step", "wait")

    def __init__(self, capacity: int = RECENT) -> None:
        self.reset(capacity)

    def reset(self, capacity: int = RECENT) -> None:
        """Forget everything (``mpar.init``); keep ``capacity`` events from now on."""
        self.capacity = capacity
        self.ring: list[Event | None] = [None] * capacity
        self.count = 0
        self.step = -1
        """Steps started on this rank, minus one (0 is the first step)."""
        self.in_step = False
        self.action: object = None
        """The schedule action running now or last (``1F3``); None before the step's first."""
        self.wait: Wait | None = None
        self.since = 0.0
        """When ``wait`` began (``time.time()``)."""
        self.last = time.time()
        """When this rank last made progress: its latest event."""

    def _record(self, kind: str, what: object) -> None:
        now = time.time()
        self.last = now
        self.ring[self.count % self.capacity] = (now, self.step, kind, what)
        self.count += 1

    def begin_step(self) -> None:
        self.step += 1
        self.in_step = True
        self.action = None
        self._record("step", None)

    def end_step(self, ok: bool = True) -> None:
        self.in_step = False
        self._record("end" if ok else "raised", None)

    def begin(self, action: object) -> None:
        """A schedule action starts (its text form is ``str(action)``)."""
        self.action = action
        self._record("action", action)

    def begin_wait(self, what: Wait) -> None:
        self.since = time.time()
        self.wait = what
        if what[0] == "collective":
            self._record("collective", what)

    def end_wait(self) -> None:
        self.wait = None
        self.last = time.time()

    def is_fresh(self) -> bool:
        """Whether nothing was recorded since a reset to the default capacity."""
        return (
            self.capacity == RECENT
            and self.count == 0
            and self.step == -1
            and not self.in_step
            and self.action is None
            and self.wait is None
        )

    def recent(self) -> list[Event]:
        """The flight recorder, oldest first."""
        count, ring = self.count, self.ring[:]  # the main thread may record meanwhile:
        start = max(0, count - self.capacity)  # a slot may then hold a newer event,
        found = [ring[i % self.capacity] for i in range(start, count)]
        return sorted((e for e in found if e is not None), key=lambda e: e[0])  # so: by time


PROGRESS = Progress()
"""This process's position (reset by ``mpar.init``)."""


class Waiting:
    """``with Waiting(("recv", src, label)):`` marks a blocking wait for a peer."""

    __slots__ = ("what",)

    def __init__(self, what: Wait) -> None:
        self.what = what

    def __enter__(self) -> None:
        PROGRESS.begin_wait(self.what)

    def __exit__(self, *exc: object) -> None:
        PROGRESS.end_wait()


class WatchedWork:
    """A collective's work handle whose ``wait()`` is marked as a wait for its group."""

    __slots__ = ("what", "work")

    def __init__(self, work: Work, what: Wait) -> None:
        self.work, self.what = work, what

    def wait(self) -> object:
        with Waiting(self.what):
            return self.work.wait()

    def __getattr__(self, name: str) -> object:
        return getattr(self.work, name)


def watched(work: Work | None, name: str, group: ProcessGroup | None) -> WatchedWork | None:
    """``work`` (or None) wrapped so that waiting on it shows in this rank's position."""
    return None if work is None else WatchedWork(work, ("collective", name, group))


def describe_label(label: TransferLabel) -> str:
    """A transfer's label in words: ``"activations for 1F3"``."""
    return label.describe()


def describe_wait(what: Wait | None, group_ranks: list[int] | None = None) -> str:
    """``what`` in words, e.g. ``"recv of activations for 1F0 from rank 0"``."""
    if what is None:
        return "nothing"
    kind, peer, detail = what
    if kind == "recv":
        data = detail.describe() if isinstance(detail, TransferLabel) else f"transfer {detail}"
        return f"recv of {data} from rank {peer}"
    if kind == "send":
        return f"sends to rank {peer} to complete"
    over = "every rank" if group_ranks is None else f"ranks {group_ranks}"
    return f"collective {peer} over {over}"
