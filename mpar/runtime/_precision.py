"""Mixed precision at the runtime's edges: which dtype, and casting nested inputs.

With ``bf16`` or ``fp16`` the stages compute in that dtype (their parameters
and buffers are converted by :class:`mpar.shard.ShardedStages`, which keeps
fp32 master copies for the optimizer). Floating-point inputs of the first
stage are cast to it, and floating-point outputs of the last stage are cast
back to float32 before the step function sees them, so losses are computed
(and scaled, under fp16) in float32.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from mpar._tree import tree_map
from mpar.config import Config

__all__ = ["cast_floats", "compute_dtype", "reduce_dtype"]

T = TypeVar("T")


def compute_dtype(config: Config) -> torch.dtype | None:
    """The dtype stages compute in under mixed precision; None for full precision."""
    if config.bf16:
        return torch.bfloat16
    if config.fp16:
        return torch.float16
    return None


def reduce_dtype(config: Config) -> torch.dtype | None:
    """The dtype gradients accumulate and reduce in under mixed precision
    (``grad_reduce_dtype``): the compute dtype when asked for, else None (fp32, the
    parameters' own dtype)."""
    return compute_dtype(config) if config.low_precision_grads else None


def cast_floats(value: T, dtype: torch.dtype | None) -> T:
    """``value`` with every floating-point tensor (also nested) cast to ``dtype``."""
    if dtype is None:
        return value
    return tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, value)
