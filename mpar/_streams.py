"""Side streams and events: the device seam's part that lets communication and copies
overlap compute (as FSDP2 and DeepSpeed do on CUDA).

Work that ZeRO issues is named by the stream it belongs on:

* ``"gather"``: ZeRO-3 all-gathers of a unit's parameters;
* ``"copy_in"``: host-to-device copies of offloaded parameter shards (before their gather);
* ``"reduce"``: reduce-scatters (and all-reduces) of gradients;
* ``"copy_out"``: device-to-host copies of offloaded gradients.

:meth:`Streams.issue` runs a piece of work on its stream and returns a :class:`Ticket`;
the compute stream waits for it (:meth:`Ticket.wait`) only where it reads the result:
the gather of the unit it is about to run, the reductions before the optimizer reads
them. A ticket can also order another side stream after it (``after=``), so the gather
of an offloaded shard waits for its copy-in, not the compute stream.

Implementations:

* :class:`HostStreams` (CPU, XLA, and CUDA tensors on a host-staged backend): one
  stream; the work runs when issued and :meth:`Ticket.wait` waits for its handle (a
  gloo collective's ``wait()``), which is what mpar did before streams existed;
* :class:`CudaStreams` (CUDA with NCCL): a ``torch.cuda.Stream`` per name; issuing
  makes the side stream wait for nothing but the ``after`` tickets and the fences
  (:meth:`Streams.fence`: parameters written on the compute stream, gradients of the
  unit just computed), records an event there; a ticket's wait is
  ``compute.wait_event``: no host synchronisation;
* a recording seam for tests (``mpar.testing.record_streams``) that runs as
  :class:`HostStreams` does and logs every stream, fence, issue and wait.

Memory safety (the caching allocator frees a block for reuse on the stream that
allocated it as soon as the host drops it): a tensor allocated on one stream and used
on another is handed to :meth:`Streams.used_on` with the stream that reads it, which
calls ``record_stream`` on CUDA, so its block is not reused before that stream's
queued work has run. FSDP2 keeps references until an event completes instead; both
keep the memory alive exactly as long as the other stream needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import torch

from mpar._device import wait_event, wire_device

__all__ = [
    "COMPUTE",
    "CudaStreams",
    "HostStreams",
    "StreamName",
    "Streams",
    "Ticket",
    "install",
    "streams_for",
]

StreamName = Literal["compute", "gather", "copy_in", "reduce", "copy_out"]
COMPUTE: StreamName = "compute"


class Work(Protocol):
    def wait(self) -> object: ...


class Ticket:
    """Work issued on a side stream: :meth:`wait` before the compute stream reads what it
    writes (at most once; later calls do nothing)."""

    def __init__(
        self,
        streams: Streams,
        stream: StreamName,
        label: str,
        work: Work | None,
        event: object = None,
    ) -> None:
        self.streams = streams
        self.stream = stream
        self.label = label
        self.work = work
        """The handle still to wait for on the host (host streams), else None."""
        self.event = event
        """The event recorded after the work on its stream (CUDA), else None."""
        self.done = False

    def wait(self) -> None:
        """Make the compute stream wait for this work (on the host: wait for its handle)."""
        if not self.done:
            self.done = True
            self.streams.wait(self, COMPUTE)


class Streams:
    """The seam (see the module docstring); this base class is the host's: one stream."""

    overlaps = False
    """Whether work issued here runs beside the compute stream (side streams), so that
    starting it early pays (a copy to the host from the backward)."""

    def issue(
        self,
        stream: StreamName,
        label: str,
        fn: Callable[[], Work | None],
        *,
        after: Sequence[Ticket] = (),
    ) -> Ticket:
        """Run ``fn`` (which starts the work and returns its handle, or None) on ``stream``,
        after the work of ``after``; returns the ticket to wait for."""
        for ticket in after:
            self.wait(ticket, stream)
        with self.on(stream):
            work = fn()
            return self._ticket(stream, label, work)

    def on(self, stream: StreamName) -> contextlib.AbstractContextManager[None]:
        """A context in which kernels and allocations go to ``stream``."""
        return contextlib.nullcontext()

    def _ticket(self, stream: StreamName, label: str, work: Work | None) -> Ticket:
        return Ticket(self, stream, label, work)

    def wait(self, ticket: Ticket, stream: StreamName) -> None:
        """Order ``stream`` after ``ticket``'s work."""
        work, ticket.work = ticket.work, None
        if work is not None:
            work.wait()

    def marker(self, stream: StreamName, label: str) -> Ticket:
        """A ticket for the work queued on ``stream`` so far (issued nothing itself): what
        :meth:`wait_host` waits for after a copy queued there."""
        return Ticket(self, stream, label, None)

    def wait_host(self, ticket: Ticket) -> None:
        """Block the host until ``ticket``'s work has run (a copy to host memory that the
        host reads next). On the host's one stream the work already ran, or its handle
        is waited for here. The caller counts the wait in the sync ledger."""
        work, ticket.work = ticket.work, None
        if work is not None:
            work.wait()

    def fence(self, stream: StreamName, label: str) -> None:
        """Order ``stream``'s next work after everything queued on the compute stream so
        far (parameters just updated, gradients just computed)."""

    def used_on(self, tensor: torch.Tensor, stream: StreamName) -> None:
        """``tensor`` (allocated elsewhere) is read or written by ``stream``'s queued work:
        keep its memory until that work has run."""


class HostStreams(Streams):
    """One stream: work runs when issued, tickets wait for their handles."""


class CudaStreams(Streams):
    """A side ``torch.cuda.Stream`` per name on one device; events between them."""

    overlaps = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams: dict[str, torch.cuda.Stream] = {}

    def _stream(self, name: StreamName) -> torch.cuda.Stream:
        if name == COMPUTE:
            return torch.cuda.current_stream(self.device)
        if name not in self.streams:
            self.streams[name] = torch.cuda.Stream(self.device)
        return self.streams[name]

    def on(self, stream: StreamName) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self._stream(stream))

    def _ticket(self, stream: StreamName, label: str, work: Work | None) -> Ticket:
        # NCCL's wait() only orders the current (side) stream after the collective's
        # own stream: the host does not block, and the event marks the result
        if work is not None:
            work.wait()
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return Ticket(self, stream, label, None, event)

    def wait(self, ticket: Ticket, stream: StreamName) -> None:
        if isinstance(ticket.event, torch.cuda.Event):
            self._stream(stream).wait_event(ticket.event)

    def marker(self, stream: StreamName, label: str) -> Ticket:
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return Ticket(self, stream, label, None, event)

    def wait_host(self, ticket: Ticket) -> None:
        if isinstance(ticket.event, torch.cuda.Event):
            wait_event(ticket.event)

    def fence(self, stream: StreamName, label: str) -> None:
        self._stream(stream).wait_stream(torch.cuda.current_stream(self.device))

    def used_on(self, tensor: torch.Tensor, stream: StreamName) -> None:
        if tensor.device.type == "cuda" and tensor.untyped_storage().size() > 0:
            tensor.record_stream(self._stream(stream))


_HOST = HostStreams()
_installed: Callable[[torch.device], Streams] | None = None
_cuda: dict[torch.device, CudaStreams] = {}


def streams_for(device: torch.device, backend: str | None) -> Streams:
    """The seam for work on ``device`` communicated over ``backend`` (None: no
    communication): side streams where the backend takes the device's tensors in place
    (NCCL on CUDA), else the host's one stream (a host-staged collective waits on the
    host anyway)."""
    if _installed is not None:
        return _installed(device)
    native = backend is None or wire_device(device, backend) == device
    if device.type == "cuda" and native:
        if device not in _cuda:
            _cuda[device] = CudaStreams(device)
        return _cuda[device]
    return _HOST


@contextlib.contextmanager
def install(factory: Callable[[torch.device], Streams] | None) -> Iterator[None]:
    """Use ``factory(device)`` as the seam inside the context (tests: a recording seam)."""
    global _installed
    before, _installed = _installed, factory
    try:
        yield
    finally:
        _installed = before
