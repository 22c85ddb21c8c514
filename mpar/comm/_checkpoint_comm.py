"""The process group and small collectives that checkpoints use.

Checkpoints get a gloo group of their own over every rank, created at the
first save or load (a collective call) and kept on the :class:`~mpar.comm.State`:
an asynchronous save runs its collectives from a background thread while the step
loop keeps using the training groups, and gloo needs host tensors whatever the
training backend.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from mpar.comm._bootstrap import State

__all__ = ["all_gather_object_in", "broadcast_object_in", "checkpoint_group"]


def checkpoint_group(st: State) -> dist.ProcessGroup:
    """The checkpoint process group of ``st`` (every rank, gloo), created on first use:
    the first call is collective."""
    if st.checkpoint_group is None:
        timeout = datetime.timedelta(seconds=st.config.timeout_s)
        st.checkpoint_group = dist.new_group(
            list(range(st.layout.world_size)), timeout=timeout, backend="gloo"
        )
    return st.checkpoint_group


def broadcast_object_in(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (which holds every rank)."""
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather_object_in(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, over ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out
