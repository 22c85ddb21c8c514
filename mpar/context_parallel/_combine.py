"""One step output from the CP group's pieces: what one process would have returned.

Each CP rank's step function sees its own tokens. The last stage's ranks of a CP group
exchange their outputs of each microbatch and combine them leaf by leaf:

* a floating-point scalar (a loss): the sum of the ranks' values times their loss
  weights (:attr:`~mpar._cp_context.CPContext.loss_weight`), the whole sequence's
  token-mean when each rank returned the mean over its tokens;
* a tensor whose axis 1 is this rank's share of the sequence (logits, hidden states):
  the pieces put back in sequence order;
* anything else: CP rank 0's value.
"""

from __future__ import annotations

from typing import Any

import torch

from mpar._cp_context import CPContext

__all__ = ["combine"]


def _leaf(values: list[Any], weights: list[float], context: CPContext) -> Any:
    first = values[0]
    if isinstance(first, float) or (
        isinstance(first, torch.Tensor) and first.is_floating_point() and first.numel() == 1
    ):
        total = sum(
            w * (v.double() if isinstance(v, torch.Tensor) else v) for w, v in zip(weights, values)
        )
        if isinstance(first, torch.Tensor):
            return torch.as_tensor(total).to(first.dtype).reshape(first.shape)
        return float(total)
    local = context.layout.local_length
    if isinstance(first, torch.Tensor) and first.dim() >= 2 and first.shape[1] == local:
        return context.layout.unshard(list(values), dim=1)
    return first


def _zip(values: list[Any], weights: list[float], context: CPContext) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return type(first)((k, _zip([v[k] for v in values], weights, context)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(
            *(_zip([v[i] for v in values], weights, context) for i in range(len(first)))
        )
    if isinstance(first, tuple | list):
        return type(first)(
            _zip([v[i] for v in values], weights, context) for i in range(len(first))
        )
    return _leaf(values, weights, context)


def combine(pieces: list[tuple[Any, float]], context: CPContext) -> Any:
    """The one-process output of a microbatch from each CP rank's ``(output, loss
    weight)``, in CP rank order."""
    return _zip([p[0] for p in pieces], [p[1] for p in pieces], context)
