"""Glue between the runtime and ``mpar.shard`` (ZeRO stages 1-3, mixed precision)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mpar.comm import State
from mpar.runtime._precision import compute_dtype
from mpar.runtime._stages import LocalStages
from mpar.shard import ShardedStages

__all__ = ["gathered", "make_sharded"]


def make_sharded(stages: LocalStages, st: State) -> ShardedStages | None:
    """ZeRO sharding of this rank's stages over its data-parallel group.

    Needed at ZeRO stage >= 1 and under mixed precision (fp32 master copies);
    otherwise None, and the plain data-parallel reducer serves.
    """
    zero, dtype = st.config.zero, compute_dtype(st.config)
    if zero.stage == 0 and dtype is None:
        return None
    return ShardedStages(
        stages.modules,
        zero,
        group=st.dp_group,
        group_ranks=st.dp_ranks,
        rank_in_group=st.dp_rank,
        device=st.device,
        compute_dtype=dtype,
        tied=stages.tied_groups,
    )


@contextmanager
def gathered(
    sharded: ShardedStages | None, stages: LocalStages, *, write_back: bool = False
) -> Iterator[None]:
    """Every local stage's full parameters while inside (collective over dp at ZeRO-3).

    With ``write_back`` the (possibly overwritten) parameters are copied back
    into the shards and optimizer master copies on exit.
    """
    if sharded is None:
        yield
        return
    for s in sorted(stages.modules):
        sharded.unshard(s)
    try:
        yield
    finally:
        for s in sorted(stages.modules):
            if write_back:
                sharded.sync_from_params(s)
            sharded.reshard(s)
