"""Flat-bucket layout: packing, padding, shard ranges and optimizer segments (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpar.shard._flat_layout import BucketSpec, Piece, Segment, SlotSpec, plan_buckets, segments_of

F32 = "float32"


def test_buckets_pack_in_order_split_on_size_and_kind_and_pad_to_the_group():
    specs = plan_buckets(
        {0: [(0, 30, F32), (1, 30, F32), (2, 50, F32), (3, 5, "bf16")], 1: [(4, 200, F32)]},
        group_size=4,
        bucket_elems=64,
    )
    assert [[s.index for s in b.slots] for b in specs] == [[0, 1], [2], [3], [4]]
    assert [b.stage for b in specs] == [0, 0, 0, 1]
    assert [(b.numel, b.padded, b.shard_numel) for b in specs] == [
        (60, 60, 15),
        (50, 52, 13),
        (5, 8, 2),
        (200, 200, 50),  # a parameter larger than a bucket gets its own
    ]
    assert specs[1].shard_range(3) == (39, 52)
    with pytest.raises(ValueError, match="not in a group of 4"):
        specs[0].shard_range(4)


def test_segments_follow_parameter_groups_and_skip_padding_and_untracked():
    bucket = BucketSpec(0, (SlotSpec(0, 0, 6), SlotSpec(1, 6, 3), SlotSpec(2, 9, 4)), 4)
    groups = {0: 0, 1: 1, 2: 1}
    # rank 2's slice is [8, 12): the tail of parameter 1 and most of parameter 2 (one group)
    assert segments_of(bucket, 8, 12, groups.get) == [
        Segment(1, 8, 12, (Piece(1, 2, 3), Piece(2, 0, 3)))
    ]
    # rank 3's slice [12, 16) holds one real element and three of padding
    assert segments_of(bucket, 12, 16, groups.get) == [Segment(1, 12, 13, (Piece(2, 3, 4),))]
    # a parameter the optimizer does not hold splits runs and is left out
    assert segments_of(bucket, 0, 16, {0: 0, 2: 0}.get) == [
        Segment(0, 0, 6, (Piece(0, 0, 6),)),
        Segment(0, 9, 13, (Piece(2, 0, 4),)),
    ]


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    n=st.integers(1, 5),
    bucket_elems=st.integers(1, 100),
    groups=st.lists(st.integers(0, 2), min_size=8, max_size=8),
)
def test_every_real_element_is_in_exactly_one_segment_of_one_rank(sizes, n, bucket_elems, groups):
    params = [(i, size, F32) for i, size in enumerate(sizes)]
    for bucket in plan_buckets({0: params}, group_size=n, bucket_elems=bucket_elems):
        assert bucket.padded % n == 0 and 0 <= bucket.padded - bucket.numel < n
        covered = []
        for rank in range(n):
            lo, hi = bucket.shard_range(rank)
            for seg in segments_of(bucket, lo, hi, lambda i: groups[i]):
                assert lo <= seg.lo < seg.hi <= hi
                assert seg.numel == sum(p.stop - p.start for p in seg.pieces)
                assert {groups[p.index] for p in seg.pieces} == {seg.group}
                covered += range(seg.lo, seg.hi)
        assert covered == list(range(bucket.numel))
