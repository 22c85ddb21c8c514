"""The process group and small collectives that checkpoints use.

Checkpoints get a gloo group of their own over every rank, created at the
first save or load (a collective call) and kept with the
:class:`~mpar.comm.ProcessGrid` (:meth:`~mpar.comm.ProcessGrid.world_group`):
an asynchronous save runs its collectives from a background thread while the step
loop keeps using the training groups, and gloo needs host tensors whatever the
training backend. Its collectives are watched by the hang watchdog, and time out
only after it has reported: a rank that never reaches a save or a load is named
with its stack.
"""

from __future__ import annotations

import contextlib
import threading
from contextlib import AbstractContextManager
from typing import TypeVar

import torch.distributed as dist

from mpar.comm._grid import ProcessGrid
from mpar.comm._progress import Waiting
from mpar.comm._types import ProcessGroup

__all__ = ["all_gather_object_in", "broadcast_object_in", "checkpoint_group"]

T = TypeVar("T")


def checkpoint_group(grid: ProcessGrid) -> dist.ProcessGroup:
    """The checkpoint process group of ``grid`` (every rank, gloo), created on first use:
    the first call is collective."""
    with _watched("new_group (checkpoint)"):
        return grid.world_group("gloo")


def _watched(name: str) -> AbstractContextManager[None]:
    """A checkpoint collective in the main thread is a wait the hang watchdog sees
    (a rank that never comes is named); in the asynchronous save's thread it is not
    (the main thread's position is the one reported)."""
    if threading.current_thread() is threading.main_thread():
        return Waiting(("collective", name, None))
    return contextlib.nullcontext()


def broadcast_object_in(obj: T, group: ProcessGroup | None) -> T:
    """Rank 0's ``obj`` on every rank of ``group`` (which holds every rank)."""
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    with _watched("broadcast (checkpoint)"):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather_object_in(obj: T, group: ProcessGroup | None) -> list[T]:
    """Every rank's ``obj``, in rank order, over ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list[T] = [obj] * size  # placeholders, overwritten
    with _watched("all_gather (checkpoint)"):
        dist.all_gather_object(out, obj, group=group)
    return out
