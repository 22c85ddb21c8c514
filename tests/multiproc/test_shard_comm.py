"""ZeRO's flat collectives on gloo (``mpar.comm._shard_comm``): gathers in pieces, and
reduce-scatters that add into the output.

Gloo's all-gather receives into a temporary the size of its whole output, so a
large gather runs in pieces of at most ``GLOO_PIECE_BYTES`` of output; the test
lowers that bound to a few elements and checks both the values and the size of
every collective gloo was given.
"""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed


def _collectives(n: int):
    import torch
    import torch.distributed as dist

    from mpar.comm import _shard_comm

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    sizes: list[int] = []
    original = dist.all_gather

    def recording(places, shard, **kwargs):
        sizes.append(sum(t.numel() for t in places))
        return original(places, shard, **kwargs)

    _shard_comm.GLOO_PIECE_BYTES = 7 * 4 * size  # pieces of 7 elements per rank
    dist.all_gather = recording
    try:
        shard = torch.arange(n, dtype=torch.float32) + 100 * rank
        out = {}
        for async_op in (False, True):
            full = torch.full((n * size,), float("nan"))
            work = _shard_comm.all_gather_flat(
                full, shard, group=None, size=size, async_op=async_op
            )
            if work is not None:
                work.wait()
            out[async_op] = full
        # in place: the shard is this rank's slice of the output
        full = torch.full((n * size,), float("nan"))
        full[rank * n : (rank + 1) * n] = shard
        _shard_comm.all_gather_flat(full, full[rank * n : (rank + 1) * n], group=None, size=size)
        out["in_place"] = full
    finally:
        dist.all_gather = original
    # reduce-scatter adding into the output (the reduced shard of earlier microbatches)
    flat = torch.arange(n * size, dtype=torch.float32) * (rank + 1)
    acc = torch.ones(n)
    _shard_comm.reduce_scatter_flat(acc, flat, group=None, size=size, accumulate=True)
    fresh = torch.empty(n)
    flat = torch.arange(n * size, dtype=torch.float32) * (rank + 1)
    _shard_comm.reduce_scatter_flat(fresh, flat, group=None, size=size, async_op=True).wait()
    dist.destroy_process_group()
    return out, sizes, acc, fresh


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_gloo_gathers_in_pieces_and_reduce_scatter_adds_into_the_output(size):
    import torch

    n = 30  # 7 + 7 + 7 + 7 + 2 elements per rank
    expected = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r for r in range(size)])
    factor = sum(r + 1 for r in range(size))
    for rank, (out, sizes, acc, fresh) in enumerate(run_distributed(_collectives, size, args=(n,))):
        for got in out.values():
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert sizes == [7 * size, 7 * size, 7 * size, 7 * size, 2 * size] * 3
        mine = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * factor
        torch.testing.assert_close(fresh, mine, rtol=0, atol=0)
        torch.testing.assert_close(acc, mine + 1, rtol=0, atol=0)
