"""Collectives over one explicit group, for ZeRO sharding (``mpar.shard``).

Every function takes the process group and its size, so a group of one
process (no data parallelism) never touches ``torch.distributed``: gathers
and reduce-scatters become copies and reductions are no-ops. Asynchronous
variants return a work handle with ``wait()`` (or None when nothing was
started); flat tensors only.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from mpar import _device
from mpar.comm import _staging
from mpar.comm._progress import Waiting, watched
from mpar.comm._types import ProcessGroup, Work

T = TypeVar("T")

__all__ = [
    "all_gather_flat",
    "all_gather_objects",
    "all_reduce_flat",
    "broadcast_flat",
    "reduce_scatter_flat",
]


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group: ProcessGroup | None,
    size: int,
    async_op: bool = False,
) -> Work | None:
    """Concatenate every rank's ``shard`` (equal sizes) into ``output``.

    ``shard`` may be this rank's own slice of ``output`` (in place).
    """
    if output.numel() != shard.numel() * size:
        raise ValueError(
            f"all_gather_flat: output has {output.numel()} elements but {size} shards of "
            f"{shard.numel()} make {shard.numel() * size}"
        )
    if size == 1:
        if not _device.same_memory(output, shard):
            output.copy_(shard)
        return None
    if _gather_in_pieces(output, group):
        pieces = _Pieces(_gather_pieces(output, shard, group=group, size=size))
        if async_op:
            return pieces
        with Waiting(("collective", "all_gather", group)):
            pieces.wait()
        return None
    if async_op:
        work = _staging.all_gather_into(output, shard, group=group, async_op=True)
        return watched(work, "all_gather", group)
    with Waiting(("collective", "all_gather", group)):
        return _staging.all_gather_into(output, shard, group=group, async_op=False)


GLOO_PIECE_BYTES = 16 * 2**20
"""Gloo's all-gather receives into a temporary the size of its whole output, then
copies it out (measured with torch 2.13, 2 CPU ranks: 125 MiB more resident memory
for a 125 MiB gather; its all-reduce of the same buffer, 3 MiB). Larger gathers on
gloo therefore run in pieces of at most this many output bytes, so the
temporaries stay that small."""


def _gather_in_pieces(output: torch.Tensor, group: ProcessGroup | None) -> bool:
    return (
        output.nbytes > GLOO_PIECE_BYTES
        and dist.get_backend(group) == "gloo"
        and _device.wire_device(output.device, "gloo") == output.device
    )


def _gather_pieces(
    output: torch.Tensor, shard: torch.Tensor, *, group: ProcessGroup | None, size: int
) -> list[Work | None]:
    """Start gathering ``shard`` into ``output`` piece by piece: each piece is the same
    range of every rank's shard, received straight into its places in ``output``."""
    n = shard.numel()
    step = max(1, GLOO_PIECE_BYTES // (shard.element_size() * size))
    works: list[Work | None] = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        places = [output[r * n + lo : r * n + hi] for r in range(size)]
        work = dist.all_gather(places, shard[lo:hi], group=group, async_op=True)
        works.append(watched(work, "all_gather", group))
    return works


class _Pieces:
    """Work handle of several collectives: ``wait()`` waits for each, in order."""

    def __init__(self, works: list[Work | None]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []
        return True


class _SliceAfter:
    """Work handle of an all-reduce whose ``wait()`` then copies (or adds) this rank's
    slice out."""

    def __init__(
        self,
        work: Work | None,
        flat: torch.Tensor,
        output: torch.Tensor,
        rank: int,
        accumulate: bool = False,
    ) -> None:
        self.work, self.flat, self.output, self.rank = work, flat, output, rank
        self.accumulate = accumulate

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            n = self.output.numel()
            mine = self.flat[self.rank * n : (self.rank + 1) * n]
            if self.accumulate:
                self.output.add_(mine)
            else:
                self.output.copy_(mine)
            self.work = None
        return True


class _AddAfter:
    """Work handle of a reduce-scatter into a temporary whose ``wait()`` then adds it
    to the output."""

    def __init__(self, work: Work | None, part: torch.Tensor, output: torch.Tensor) -> None:
        self.work, self.part, self.output = work, part, output

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.output.add_(self.part)
            self.work = None
        return True


def _scatter_by_all_reduce(group: ProcessGroup | None) -> bool:
    """Gloo's reduce-scatter is about twice as slow as its all-reduce of the same
    buffer (measured with torch 2.13 on 2 and 4 CPU ranks: 25 vs 12 ms and 75 vs
    34 ms for 18 MB), so on gloo the sum is an all-reduce and the slice a copy."""
    return dist.get_backend(group) == "gloo"


def reduce_scatter_flat(
    output: torch.Tensor,
    flat: torch.Tensor,
    *,
    group: ProcessGroup | None,
    size: int,
    async_op: bool = False,
    accumulate: bool = False,
) -> Work | None:
    """Sum ``flat`` over the group and leave this rank's equal slice in ``output``
    (``accumulate``: add it to ``output``; on gloo with no buffer of the slice's size).

    ``flat`` is scratch: its contents afterwards are unspecified (on gloo it
    holds the whole sum).
    """
    if flat.numel() != output.numel() * size:
        raise ValueError(
            f"reduce_scatter_flat: input has {flat.numel()} elements, not {size} x {output.numel()}"
        )
    if size == 1:
        if accumulate:
            output.add_(flat)
        else:
            output.copy_(flat)
        return None
    if _scatter_by_all_reduce(group):
        summed = watched(
            _staging.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True),
            "reduce_scatter",
            group,
        )
        handle = _SliceAfter(summed, flat, output, dist.get_rank(group), accumulate)
        if async_op:
            return handle
        handle.wait()
        return None
    if accumulate:
        part = torch.empty_like(output)
        added = _AddAfter(
            reduce_scatter_flat(part, flat, group=group, size=size, async_op=True), part, output
        )
        if async_op:
            return added
        added.wait()
        return None
    if async_op:
        work = _staging.reduce_scatter_into(output, flat, group=group, async_op=True)
        return watched(work, "reduce_scatter", group)
    with Waiting(("collective", "reduce_scatter", group)):
        return _staging.reduce_scatter_into(output, flat, group=group, async_op=False)


def all_reduce_flat(
    tensor: torch.Tensor, *, group: ProcessGroup | None, size: int, async_op: bool = False
) -> Work | None:
    """Sum ``tensor`` in place over the group."""
    if size == 1:
        return None
    if async_op:
        work = _staging.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return watched(work, "all_reduce", group)
    with Waiting(("collective", "all_reduce", group)):
        return _staging.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=False)


def broadcast_flat(
    tensor: torch.Tensor, *, src: int, group: ProcessGroup | None, size: int
) -> None:
    """Overwrite ``tensor`` with global rank ``src``'s copy (``src`` is in the group)."""
    if size > 1:
        with Waiting(("collective", "broadcast", group)):
            _staging.broadcast(tensor, src=src, group=group)


def all_gather_objects(obj: T, *, group: ProcessGroup | None, size: int) -> list[T]:
    """Every group member's picklable ``obj``, in group order."""
    if size == 1:
        return [obj]
    out: list[T] = [obj] * size  # placeholders, overwritten
    with Waiting(("collective", "all_gather_object", group)):
        dist.all_gather_object(out, obj, group=group)
    return out
