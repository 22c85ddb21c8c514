"""Flat-buffer layout: which parameter goes where (pure: integers only).

A stage's trainable parameters are packed, in module order, into flat
buckets of at most ``bucket_elems`` elements (a parameter larger than that
gets a bucket of its own). Each bucket is zero-padded to a multiple of the
group size ``n`` so that rank ``r`` owns the equal slice
``[r * numel // n, (r + 1) * numel // n)`` of the padded buffer::

    params   | a a a a a | b b b | c c |  pad |     numel 10, n 4 -> padded 12
    shards   |  rank 0  |  rank 1  |  rank 2  |  rank 3 |   3 elements each

A :class:`Segment` is a run of consecutive elements of one slice that belong
to parameters of the same optimizer parameter group; each becomes one flat
parameter of the rebuilt optimizer (padding is never in a segment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BucketSpec", "Piece", "Segment", "SlotSpec", "plan_buckets", "segments_of"]


@dataclass(frozen=True)
class SlotSpec:
    """One parameter inside a bucket: ``index`` is its position in the local list."""

    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketSpec:
    """One flat buffer of one stage, padded to a multiple of ``group_size``."""

    stage: int
    slots: tuple[SlotSpec, ...]
    group_size: int

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        last = self.slots[-1]
        return last.offset + last.numel

    @property
    def padded(self) -> int:
        n = self.group_size
        return -(-self.numel // n) * n

    @property
    def shard_numel(self) -> int:
        return self.padded // self.group_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``rank``'s slice in the padded buffer."""
        if not 0 <= rank < self.group_size:
            raise ValueError(f"rank {rank} is not in a group of {self.group_size}")
        size = self.shard_numel
        return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``index`` (flattened) inside a segment."""

    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class Segment:
    """``[lo, hi)`` of a bucket (bucket coordinates), all in optimizer group ``group``."""

    group: int
    lo: int
    hi: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def plan_buckets(
    stage_params: dict[int, Sequence[tuple[int, int, object]]],
    *,
    group_size: int,
    bucket_elems: int,
) -> list[BucketSpec]:
    """Pack each stage's ``(index, numel, kind)`` parameters into buckets.

    ``kind`` (dtype and device) must be equal within a bucket; a change of
    kind starts a new bucket. Stages are packed in increasing order.
    """
    if group_size < 1 or bucket_elems < 1:
        raise ValueError(
            f"group_size ({group_size}) and bucket_elems ({bucket_elems}) must be >= 1"
        )
    buckets: list[BucketSpec] = []
    for stage in sorted(stage_params):
        current: list[SlotSpec] = []
        kind: object = None
        offset = 0
        for index, numel, param_kind in stage_params[stage]:
            full = current and offset + numel > bucket_elems
            if current and (full or param_kind != kind):
                buckets.append(BucketSpec(stage, tuple(current), group_size))
                current, offset = [], 0
            current.append(SlotSpec(index, offset, numel))
            kind = param_kind
            offset += numel
        if current:
            buckets.append(BucketSpec(stage, tuple(current), group_size))
    return buckets


def segments_of(
    bucket: BucketSpec, lo: int, hi: int, group_of: Callable[[int], int | None]
) -> list[Segment]:
    """The segments of ``[lo, hi)``: runs of elements whose parameters share a group.

    ``group_of(index)`` is the optimizer parameter group of a parameter, or
    None when the optimizer does not update it (such elements are skipped).
    """
    segments: list[Segment] = []
    run: list[Piece] = []
    run_group = -1
    run_lo = run_hi = 0
    for slot in bucket.slots:
        start = max(lo, slot.offset)
        stop = min(hi, slot.offset + slot.numel)
        if start >= stop:
            continue
        group = group_of(slot.index)
        contiguous = run and run_group == group and start == run_hi
        if run and not contiguous:
            segments.append(Segment(run_group, run_lo, run_hi, tuple(run)))
            run = []
        if group is None:
            continue
        if not run:
            run_group, run_lo = group, start
        run.append(Piece(slot.index, start - slot.offset, stop - slot.offset))
        run_hi = stop
    if run:
        segments.append(Segment(run_group, run_lo, run_hi, tuple(run)))
    return segments
