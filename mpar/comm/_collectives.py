"""Collectives over a :class:`~mpar.comm.ProcessGrid`'s groups, with errors that name
the group and cause. Each takes the grid it runs on (nothing is looked up)."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from mpar import _device
from mpar.comm import _staging
from mpar.comm._grid import ProcessGrid
from mpar.comm._progress import Waiting, WatchedWork, watched
from mpar.comm._types import ProcessGroup

__all__ = [
    "all_gather_object_ep",
    "all_gather_object_cp",
    "all_gather_object_pp",
    "all_reduce_dp",
    "all_reduce_dp_async",
    "all_reduce_group",
    "all_reduce_pp",
    "barrier",
    "broadcast_object_world",
    "gather_step_outputs",
    "group_size",
    "world_all_reduce",
]

T = TypeVar("T")


def barrier() -> None:
    """Wait until every rank of the world group reaches this point."""
    with Waiting(("collective", "barrier", None)):
        dist.barrier()


def all_reduce_dp(tensor: torch.Tensor, grid: ProcessGrid, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over this rank's data-parallel group."""
    if grid.dp_size > 1:
        with Waiting(("collective", "all_reduce", grid.dp_group)):
            _staging.all_reduce(tensor, op=_op(op), group=grid.dp_group)
    return tensor


def world_all_reduce(tensor: torch.Tensor, grid: ProcessGrid, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over every rank."""
    if grid.world_size > 1:
        with Waiting(("collective", "all_reduce", None)):
            _staging.all_reduce(tensor, op=_op(op), group=None)
    return tensor


def _op(name: str) -> dist.ReduceOp.RedOpType:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if name not in ops:
        raise ValueError(f"reduction {name!r} is not one of {sorted(ops)}")
    return ops[name]


def broadcast_object_world(obj: T, grid: ProcessGrid, src: int = 0) -> T:
    """Send a picklable object from global rank ``src`` to every rank."""
    if grid.world_size == 1:
        return obj
    box = [obj]
    with Waiting(("collective", "broadcast_object", None)):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def _all_gather_object(obj: T, group: ProcessGroup | None, size: int) -> list[T]:
    if size == 1:
        return [obj]
    out: list[T] = [obj] * size  # placeholders, overwritten
    with Waiting(("collective", "all_gather_object", group)):
        dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_object_world(obj: T, grid: ProcessGrid) -> list[T]:
    """Every rank's ``obj``, in global rank order."""
    return _all_gather_object(obj, None, grid.world_size)  # None: the default group


def all_gather_object_pp(obj: T, grid: ProcessGrid) -> list[T]:
    """Every pipeline stage's ``obj`` (this rank's pipeline), in stage order."""
    return _all_gather_object(obj, grid.pp_group, grid.pp_size)


def gather_step_outputs(own: T | None, last: int, grid: ProcessGrid) -> list[T]:
    """Every data-parallel replica's step outputs, in replica order, on every rank.

    ``own``: this rank's replica's outputs where it holds the last stage (pipeline
    rank ``last``), else None. With tensor parallelism TP rank 0's are the replica's
    (broadcast over the last stage's TP group). They are broadcast within each
    pipeline from the last stage's rank, then all-gathered over the data-parallel
    group (over every rank where that group takes no objects: XLA's): two collectives
    (three with TP), no message between every pair of ranks.
    """
    value: object = own
    if grid.tp_size > 1 and grid.pp_rank == last and _objects(grid.tp_group):
        # TP rank 0's are the replica's (a vocabulary-parallel head splits them)
        value = _broadcast_object(
            value, grid.rank_of(last, grid.dp_rank, 0, grid.cp_rank), grid.tp_group
        )
    if grid.pp_size > 1:  # (each CP rank's pipeline: the CP group's outputs are combined)
        src = grid.rank_of(last, grid.dp_rank, grid.tp_rank, grid.cp_rank)
        value = _broadcast_object(value, src, grid.pp_group)
    group: ProcessGroup | None = grid.dp_group
    size = grid.dp_size
    if size > 1 and not _objects(grid.dp_group):
        group, size = None, grid.world_size  # (the world group is gloo there)
    entries = _all_gather_object((grid.pp_rank, grid.tp_rank, grid.dp_rank, value), group, size)
    mine = [e for e in entries if e[:2] == (grid.pp_rank, grid.tp_rank)]
    return [e[3] for e in sorted(mine, key=lambda e: e[2])]  # type: ignore[misc]


def _broadcast_object(obj: object, src: int, group: ProcessGroup) -> object:
    box = [obj]
    with Waiting(("collective", "broadcast_object (step outputs)", group)):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _objects(group: ProcessGroup) -> bool:
    """Whether ``group`` takes torch's object collectives."""
    return _device.takes_objects(str(dist.get_backend(group)))


def all_gather_object_tp(obj: T, grid: ProcessGrid) -> list[T]:
    """Every tensor-parallel rank's ``obj`` (this rank's TP group), in TP rank order."""
    return _all_gather_object(obj, grid.tp_group, grid.tp_size)


def all_gather_object_ep(obj: T, grid: ProcessGrid) -> list[T]:
    """Every ep rank's ``obj`` (this rank's ep group), in ep rank order."""
    return _all_gather_object(obj, grid.ep_group, grid.ep_size)


def all_gather_object_cp(obj: T, grid: ProcessGrid) -> list[T]:
    """Every context-parallel rank's ``obj`` (this rank's CP group), in CP rank order."""
    return _all_gather_object(obj, grid.cp_group, grid.cp_size)


def all_reduce_tp(tensor: torch.Tensor, grid: ProcessGrid, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over this rank's tensor-parallel group."""
    if grid.tp_size > 1:
        with Waiting(("collective", "all_reduce", grid.tp_group)):
            _staging.all_reduce(tensor, op=_op(op), group=grid.tp_group)
    return tensor


def all_reduce_pp(tensor: torch.Tensor, grid: ProcessGrid, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over this rank's pipeline."""
    if grid.pp_size > 1:
        with Waiting(("collective", "all_reduce", grid.pp_group)):
            _staging.all_reduce(tensor, op=_op(op), group=grid.pp_group)
    return tensor


def all_reduce_dp_async(tensor: torch.Tensor, grid: ProcessGrid) -> WatchedWork | None:
    """Start a sum all-reduce over the data-parallel group; returns a waitable (or None)."""
    if grid.dp_size == 1:
        return None
    work = _staging.all_reduce(tensor, op=_op("sum"), group=grid.dp_group, async_op=True)
    return watched(work, "all_reduce", grid.dp_group)


def all_reduce_group(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum all-reduce ``tensor`` in place over ``group``."""
    with Waiting(("collective", "all_reduce", group)):
        _staging.all_reduce(tensor, op=_op("sum"), group=group)
    return tensor


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``."""
    return int(dist.get_world_size(group))
