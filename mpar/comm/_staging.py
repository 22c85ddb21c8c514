"""Collectives on tensors of any device, host-staged where the backend cannot take them.

Each function here is the ``torch.distributed`` collective of the same name
with one difference: when the group's backend does not communicate tensors of
the argument's device (``mpar._device.wire_device`` decides: an XLA tensor
on gloo, say), the tensor is copied to the host, the collective runs there,
and the result is copied back into the original tensor — at once, or, with
``async_op=True``, when the returned handle's ``wait()`` is called. Where the
backend takes the tensor as it is, nothing is copied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpar import _device
from mpar.comm._types import ProcessGroup, Work

__all__ = ["StagedWork", "all_gather_into", "all_reduce", "broadcast", "reduce_scatter_into"]


class StagedWork:
    """A collective's work handle; ``wait()`` also copies host results back."""

    def __init__(self, work: Work | None, results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.work, self.results = work, results

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
        for target, host in self.results:
            target.copy_(host)
        self.results = []
        return True


def _wire(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``tensor``, or a host copy of it when the group's backend cannot take it."""
    where = _device.wire_device(tensor.device, str(dist.get_backend(group)))
    return tensor if where == tensor.device else tensor.to(where)


def _finish(
    work: Work | None, results: list[tuple[torch.Tensor, torch.Tensor]], async_op: bool
) -> Work | None:
    staged = [(t, h) for t, h in results if t is not h]
    if not staged:
        return work
    handle = StagedWork(work, staged)
    if async_op:
        return handle
    handle.wait()
    return None


def all_reduce(
    tensor: torch.Tensor,
    *,
    op: dist.ReduceOp.RedOpType,
    group: ProcessGroup | None,
    async_op: bool = False,
) -> Work | None:
    """``dist.all_reduce`` in place on ``tensor``."""
    wire = _wire(tensor, group)
    work = dist.all_reduce(wire, op=op, group=group, async_op=async_op)
    return _finish(work, [(tensor, wire)], async_op)


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, *, group: ProcessGroup | None, async_op: bool = False
) -> Work | None:
    """Every rank's equal ``shard`` concatenated into ``output`` (``shard`` may be a view of it)."""
    wire_out, wire_in = _wire(output, group), _wire(shard, group)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(wire_out, wire_in, group=group, async_op=async_op)
    return _finish(work, [(output, wire_out)], async_op)


def reduce_scatter_into(
    output: torch.Tensor, flat: torch.Tensor, *, group: ProcessGroup | None, async_op: bool = False
) -> Work | None:
    """This rank's equal slice of the sum of every rank's ``flat``, into ``output``."""
    wire_out, wire_in = _wire(output, group), _wire(flat, group)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(wire_out, wire_in, group=group, async_op=async_op)
    return _finish(work, [(output, wire_out)], async_op)


def broadcast(tensor: torch.Tensor, *, src: int, group: ProcessGroup | None) -> None:
    """``dist.broadcast`` of global rank ``src``'s ``tensor``, in place."""
    wire = _wire(tensor, group)
    dist.broadcast(wire, src=src, group=group)
    _finish(None, [(tensor, wire)], False)
