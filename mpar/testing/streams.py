"""A recording stream seam: the CPU stand-in for CUDA's side streams in tests.

:func:`record_streams` installs, for the ``with`` block, a seam that works as the
host's one stream does (collectives wait for their handles, so training is unchanged)
and records, in order, what a CUDA run would do with streams and events::

    with record_streams() as log:
        ...train...
    [r for r in log if r.op == "wait" and r.stream == "compute"]

Each :class:`StreamRecord` is one of

* ``fence``: ``stream`` is ordered after the compute stream's work so far;
* ``issue``: work (``label``) started on ``stream``;
* ``wait``: ``stream`` waits for the work of ``ticket`` (``"gather:stage 1 bucket@3"``);
* ``host``: the host waits for the work of ``ticket`` (an offloaded gradient's copy,
  before the host optimizer reads it);
* ``keep``: a tensor used by ``stream`` keeps its memory for it (``record_stream``);
* ``mark``: a note a test adds itself (:func:`mark`), to place the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from mpar import _streams
from mpar._streams import StreamName, Ticket, Work

__all__ = ["RecordingStreams", "StreamRecord", "mark", "record_streams"]


class StreamRecord(NamedTuple):
    op: str
    """``fence``, ``issue``, ``wait``, ``host``, ``keep`` or ``mark``."""
    stream: str
    label: str
    """What was issued or fenced (``"stage 1 bucket@3"``), or for a wait the ticket
    waited for as ``"<its stream>:<its label>"``."""


class RecordingStreams(_streams.HostStreams):
    """The host's one stream, recording every call into ``log``; it reports side
    streams (``overlaps``), so mpar issues what it would on CUDA."""

    overlaps = True

    def __init__(self, log: list[StreamRecord]) -> None:
        self.log = log

    def _ticket(self, stream: StreamName, label: str, work: Work | None) -> Ticket:
        self.log.append(StreamRecord("issue", stream, label))
        return super()._ticket(stream, label, work)

    def wait(self, ticket: Ticket, stream: StreamName) -> None:
        self.log.append(StreamRecord("wait", stream, f"{ticket.stream}:{ticket.label}"))
        super().wait(ticket, stream)

    def wait_host(self, ticket: Ticket) -> None:
        self.log.append(StreamRecord("host", "host", f"{ticket.stream}:{ticket.label}"))
        super().wait_host(ticket)

    def fence(self, stream: StreamName, label: str) -> None:
        self.log.append(StreamRecord("fence", stream, label))

    def used_on(self, tensor: torch.Tensor, stream: StreamName) -> None:
        self.log.append(StreamRecord("keep", stream, ""))


_LOGS: list[list[StreamRecord]] = []


def mark(label: str) -> None:
    """Add a ``mark`` record to the logs being recorded (no-op when none is)."""
    for log in _LOGS:
        log.append(StreamRecord("mark", "compute", label))


@contextlib.contextmanager
def record_streams() -> Iterator[list[StreamRecord]]:
    """Record the stream seam's calls made inside the block (see the module docstring)."""
    log: list[StreamRecord] = []
    seam = RecordingStreams(log)
    factory: Callable[[torch.device], _streams.Streams] = lambda device: seam  # noqa: E731
    _LOGS.append(log)
    try:
        with _streams.install(factory):
            yield log
    finally:
        _LOGS.remove(log)
