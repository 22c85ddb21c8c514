"""Collectives over mpar's groups, with errors that name the group and cause."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mpar.comm._bootstrap import state

__all__ = ["all_reduce_dp", "barrier", "broadcast_object_pp", "world_all_reduce"]


def barrier() -> None:
    """Wait until every rank reaches this point."""
    state()
    dist.barrier()


def all_reduce_dp(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over this rank's data-parallel group."""
    st = state()
    if len(st.dp_ranks) > 1:
        dist.all_reduce(tensor, op=_op(op), group=st.dp_group)
    return tensor


def world_all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over every rank."""
    if state().layout.world_size > 1:
        dist.all_reduce(tensor, op=_op(op))
    return tensor


def broadcast_object_pp(obj: Any, src_pp_rank: int) -> Any:
    """Send a picklable object from one stage of this pipeline to all its stages."""
    st = state()
    if len(st.pp_ranks) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=st.pp_ranks[src_pp_rank], group=st.pp_group)
    return box[0]


def _op(name: str) -> Any:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if name not in ops:
        raise ValueError(f"reduction {name!r} is not one of {sorted(ops)}")
    return ops[name]
