"""Which elements of each tensor this rank stores, and which it writes out.

A tensor of the model (under its state-dict key) is held on a rank as one of:

* a trainable parameter in a ZeRO bucket: the rank stores the whole parameter
  below ZeRO-3 and the part inside its shard of the bucket at ZeRO-3; the
  optimizer's ``master`` copy (full precision) covers ``opt_range``;
* anything else (buffers, frozen parameters, a model without sharding): the
  whole tensor.

Ranges are of the tensor's elements in row-major order (``tensor.reshape(-1)``).
``load_pretrained`` fills :func:`stored_range`; ``save_pretrained`` writes
:func:`written_range`, so that the ranks of a data-parallel group each write a
different part of every parameter and no element is written twice.

Under tensor parallelism a rank holds its TP piece of a split tensor
(``Share.split``): the ranges are then of the piece's elements, and
:func:`full_runs` maps them back to runs of the whole tensor. Under expert
parallelism a fused expert weight is split the same way (its rows, by ep rank), and
a per-expert tensor is held whole by one rank of the ep group only; the ranks holding
the same experts are the expert-data-parallel group, the "data-parallel group" of
those tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpar.shard._bucket import FlatBucket, Residence
from mpar.shard._flat_layout import SlotSpec
from mpar.tensor_parallel import TPShard

__all__ = ["Share", "full_runs", "local_shares", "stored_range", "written_range"]


@dataclass
class Share:
    """One tensor of the model as this rank holds it."""

    key: str
    tensor: torch.Tensor
    """The local tensor object (empty between gathers at ZeRO-3)."""
    shape: torch.Size
    """The tensor's full shape."""
    stage: int
    """The lowest local stage that holds it."""
    bucket: FlatBucket | None = None
    slot: SlotSpec | None = None
    split: TPShard | None = None
    """How it is split over ranks (this rank holds piece ``split_rank``); None: whole."""
    split_rank: int = 0
    """The piece of ``split`` this rank holds (its TP rank, or its ep rank)."""
    copy_rank: int = 0
    """This rank's place among the ranks holding the same values (its data-parallel
    rank; its expert-data-parallel rank for an expert's tensor)."""
    tp_whole: bool = True
    """Whether every rank of the TP group holds the same values (not split by TP)."""

    @property
    def local_shape(self) -> torch.Size:
        """The shape of what this rank holds of it: the whole, or its TP piece."""
        return self.shape if self.split is None else self.split.local_shape(self.shape)

    @property
    def numel(self) -> int:
        """Elements of what this rank holds (ranges below are of these, row-major)."""
        return self.local_shape.numel()


def local_shares(model: Any) -> dict[str, Share]:
    """Canonical state-dict key -> how this rank holds it (partitioned ``model``);
    a key that names the same tensor as an earlier key (a tied alias) is left out."""
    assert model.stages is not None
    where: dict[int, tuple[FlatBucket, SlotSpec]] = {}
    if model.sharded is not None:
        for bucket in model.sharded.buckets:
            for slot, p in zip(bucket.spec.slots, bucket.params):
                where[id(p)] = (bucket, slot)
    stage_of: dict[str, int] = {}
    for s in sorted(model.stages.modules, reverse=True):
        for original in model.stages.qualnames[s].values():
            stage_of[original] = s
    tensors = model.local_tensors()
    keys = model.state_keys
    out: dict[str, Share] = {}
    seen: set[int] = set()
    for key in keys.order:
        t = tensors.get(key)
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        stage = min(
            [stage_of[k] for k in keys.names_of(key) if k in stage_of],
            default=0,
        )
        bucket, slot = where.get(id(t), (None, None))
        split = model.split_of(key)
        shard, split_rank = split if split is not None else (None, 0)
        expert = model.ep_layout is not None and model.ep_layout.experts_of(key) is not None
        copy_rank = model.grid.edp_rank if expert else model.grid.dp_cp_rank
        tp_whole = model.tp_shard_of(key) is None
        out[key] = Share(
            key, t, keys.shapes[key], stage, bucket, slot, shard, split_rank, copy_rank, tp_whole
        )
    return out


def full_runs(
    share: Share, tp_rank: int, start: int, values: torch.Tensor
) -> list[tuple[int, torch.Tensor]]:
    """Elements ``[start, start + len(values))`` of what this rank holds of ``share``, as
    ``(first element, values)`` runs of the whole tensor (row-major)."""
    split = share.split
    if split is None:
        return [(start, values)]
    d, shape = split.dim, share.shape
    inner = shape[d + 1 :].numel()
    local_dim = shape[d] // split.size
    runs: list[tuple[int, torch.Tensor]] = []
    i, end = start, start + values.numel()
    while i < end:
        outer, rest = divmod(i, local_dim * inner)
        j, k = divmod(rest, inner)
        whole, run = split.whole_index(shape[d], j, tp_rank)
        stop = min(end, i + run * inner - k)  # held elements consecutive in the whole too
        runs.append(((outer * shape[d] + whole) * inner + k, values[i - start : stop - start]))
        i = stop
    return runs


def _in_bucket(share: Share, lo: int, hi: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of the share's bucket, as a range of its tensor."""
    assert share.slot is not None
    start = min(max(lo - share.slot.offset, 0), share.numel)
    stop = min(max(hi - share.slot.offset, 0), share.numel)
    return start, max(start, stop)


def stored_range(share: Share) -> tuple[int, int]:
    """The elements of the tensor this rank stores."""
    if share.bucket is None or share.bucket.zero_stage < 3:
        return 0, share.numel
    return _in_bucket(share, share.bucket.lo, share.bucket.hi)


def written_range(share: Share) -> tuple[int, int]:
    """The elements of the tensor this rank writes (given that its pipeline rank is
    the one that writes this tensor): its bucket shard's part, or all of a tensor
    outside buckets on the first of the ranks holding it (``copy_rank`` 0)."""
    if share.bucket is None:
        return (0, share.numel) if share.copy_rank == 0 else (0, 0)
    return _in_bucket(share, *share.bucket.spec.shard_range(share.bucket.comm.rank))


def read_range(share: Share, start: int, stop: int) -> torch.Tensor:
    """The current values of elements ``[start, stop)`` (full precision: the optimizer's
    master copy for a bucket parameter), without gathering anything."""
    bucket = share.bucket
    if bucket is None:
        return share.tensor.detach().reshape(-1)[start:stop]
    assert share.slot is not None
    base = share.slot.offset - bucket.opt_range[0]
    return bucket.master[base + start : base + stop]


def fill_bucket(bucket: FlatBucket, values: dict[int, tuple[int, torch.Tensor]]) -> None:
    """Overwrite this rank's elements of ``bucket`` (its whole buffer below ZeRO-3,
    its shard at ZeRO-3, and the master copy) with ``values``: slot position in the
    bucket -> (first element of the tensor given, elements in the master dtype).
    Elements not given keep their values."""
    bucket.wait_gathered()
    lo, hi = (0, bucket.spec.padded) if bucket.zero_stage < 3 else (bucket.lo, bucket.hi)
    olo, ohi = bucket.opt_range
    with torch.no_grad():
        for i, (start, data) in values.items():
            slot = bucket.spec.slots[i]
            a = slot.offset + start  # bucket coordinates of the given elements
            b = a + data.numel()
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            piece = data[a - slot.offset - start : b - slot.offset - start]
            if bucket.residence is not Residence.SHARDED:
                bucket.full[a:b].copy_(piece)
            if bucket.residence is not Residence.REPLICATED:  # ZeRO-3: a shard of its own
                bucket.shard[a - bucket.lo : b - bucket.lo].copy_(piece)
            ma, mb = max(a, olo), min(b, ohi)
            if ma < mb:
                target = bucket.master[ma - olo : mb - olo]
                target.copy_(data[ma - slot.offset - start : mb - slot.offset - start])
