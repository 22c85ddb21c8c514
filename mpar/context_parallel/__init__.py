"""Context parallelism: every sequence split over the ranks of a CP group.

See ``docs/context_parallel.md``. With ``context_parallel_degree`` (``cp``) > 1, the
ranks of a CP group take the same batch; ``@mpar.step`` cuts each microbatch's sequences
head-tail among them (``_shard``), the model's attention is replaced by the CP operators
of :mod:`mpar.comm._cp_ops` (``_attention``), and the step's outputs are put back
together (``_combine``). Gradients of the parameters (replicated over CP) are summed
over data parallel x CP.

Public: :func:`position_ids`, for a model that computes its positions itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpar._cp_context import CPContext
from mpar.comm._cp_ops import cp_position_ids
from mpar.context_parallel._attention import (
    FOUND,
    check_heads,
    hf_sdpa,
    install_hf,
    replace_sdpa,
)
from mpar.context_parallel._combine import combine
from mpar.context_parallel._shard import CallPlan, prepare_call, shard_microbatch
from mpar.errors import ContextParallelError

if TYPE_CHECKING:
    from mpar.partition import CPAttention
    from mpar.profile import ModelProfile

__all__ = [
    "FOUND",
    "CallPlan",
    "ContextParallelError",
    "check_found",
    "check_heads",
    "combine",
    "install_hf",
    "measure_cp_attention",
    "position_ids",
    "prepare_call",
    "replace_sdpa",
    "shard_batches",
]


def position_ids(like: torch.Tensor) -> torch.Tensor:
    """The global positions [B, S_local] of this rank's tokens, for a model that computes
    its positions itself (``torch.arange(seq_len)`` would number the rank's tokens from 0):
    ``like`` is any tensor [B, S_local, ...] of the stage (the hidden states, say). Outside
    context parallelism (or outside a step) it is ``arange(S)`` for every row. A model
    whose ``forward`` takes ``position_ids`` needs nothing: mpar passes them."""
    if not isinstance(like, torch.Tensor) or like.dim() < 2:
        raise TypeError(
            "mpar.context_parallel.position_ids takes a tensor [batch, sequence, ...], got "
            f"{type(like).__name__}"
            + (f" of shape {tuple(like.shape)}" if isinstance(like, torch.Tensor) else "")
        )
    return cp_position_ids(like)


def shard_batches(
    args: Sequence[tuple[object, ...]],
    kwargs: Sequence[dict[str, object]],
    names: list[str],
    cp: int,
    rank: int,
) -> tuple[list[tuple[object, ...]], list[dict[str, object]], list[CPContext]]:
    """Every microbatch's share for CP rank ``rank`` and its context (``_shard``)."""
    out_args, out_kwargs, contexts = [], [], []
    for a, k in zip(args, kwargs):
        a2, k2, context = shard_microbatch(a, k, names, cp, rank)
        out_args.append(a2)
        out_kwargs.append(k2)
        contexts.append(context)
    return out_args, out_kwargs, contexts


def measure_cp_attention(
    module: nn.Module,
    profile: ModelProfile,
    example: tuple[Sequence[object], Mapping[str, object]],
    profiled_cp: int = 1,
) -> CPAttention:
    """Where ``module`` attends at the ``example`` inputs the ``profile`` was taken at, for
    the planner (``mpar.partition.measure_attention``; a Hugging Face model attends
    through ``scaled_dot_product_attention`` meanwhile). ``profiled_cp``: the CP degree
    the example's sequences are already cut by (the runtime profiles a CP rank's)."""
    from mpar.partition import measure_attention

    args, kwargs = example
    with hf_sdpa(module):
        found = measure_attention(module, profile.units, args, kwargs, fake=profile.mode == "meta")
    return dataclasses.replace(found, profiled_cp=profiled_cp)


def check_found(found: int, module: nn.Module) -> None:
    """Raise :class:`ContextParallelError` when no attention was found in ``module``."""
    if found == 0:
        raise ContextParallelError(
            f"context parallelism found no attention in {type(module).__name__}: mpar "
            "replaces torch.nn.functional.scaled_dot_product_attention calls and Hugging "
            "Face's attention interface (config._attn_implementation). A model that "
            "computes attention otherwise (matmul and softmax of its own, an nn.Sequential "
            "run without capture) cannot split its sequences: call "
            "scaled_dot_product_attention, or use context_parallel_degree 1"
        )
