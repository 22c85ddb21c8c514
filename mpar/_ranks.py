"""Rank helpers of the public API (``mpar.rank()``, ``mpar.pp_rank()``, ...)."""

from __future__ import annotations

from mpar.comm import _collectives, state
from mpar.config import Config

__all__ = [
    "barrier",
    "config",
    "cp_rank",
    "cp_size",
    "dp_rank",
    "dp_size",
    "ep_rank",
    "ep_size",
    "local_rank",
    "local_size",
    "pp_rank",
    "pp_size",
    "rank",
    "size",
    "tp_rank",
    "tp_size",
]


def barrier() -> None:
    """Wait until every rank reaches this point."""
    state()
    _collectives.barrier()


def config() -> Config:
    """The resolved, typed configuration of the current ``mpar.init`` (a model's
    ``"auto"`` values, resolved at its first step, are on ``model.config``)."""
    return state().config


def rank() -> int:
    """Global rank of this process."""
    return state().layout.rank


def size() -> int:
    """Number of processes in the job."""
    return state().layout.world_size


def local_rank() -> int:
    """Rank of this process on its host."""
    return state().layout.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return state().layout.local_size


def pp_rank() -> int:
    """Pipeline stage index of this rank (0 .. pp_size() - 1)."""
    return state().grid.pp_rank


def pp_size() -> int:
    """Pipeline parallel degree."""
    return state().grid.pp_size


def dp_rank() -> int:
    """Index of this rank's model replica (0 .. dp_size() - 1)."""
    return state().grid.dp_rank


def dp_size() -> int:
    """Number of data-parallel replicas."""
    return state().grid.dp_size


def tp_rank() -> int:
    """Index of this rank in its tensor-parallel group (0 .. tp_size() - 1)."""
    return state().grid.tp_rank


def tp_size() -> int:
    """Tensor-parallel degree: ranks that split each layer (1 until the config sets it)."""
    return state().grid.tp_size


def ep_rank() -> int:
    """Index of this rank in its expert-parallel group (0 .. ep_size() - 1): it holds
    experts ``[ep_rank E / ep_size, (ep_rank + 1) E / ep_size)`` of each MoE layer."""
    return state().grid.ep_rank


def ep_size() -> int:
    """Expert-parallel degree: ranks that split each MoE layer's experts, folded into the
    data-parallel ranks (1 until the config sets it)."""
    return state().grid.ep_size


def cp_rank() -> int:
    """Index of this rank in its context-parallel group (0 .. cp_size() - 1): which pieces
    of each sequence it computes."""
    return state().grid.cp_rank


def cp_size() -> int:
    """Context-parallel degree: ranks that split each sequence (1 until the config sets it)."""
    return state().grid.cp_size
