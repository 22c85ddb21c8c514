"""The backward of one stage split in two: input gradients now (I), weights later (W).

``split_backward`` runs the I part and returns the W part as a function. I
walks autograd from the stage's outputs (or its loss) back to its inputs
only, so the previous stage gets its gradient as early as possible, and keeps
the gradients that reach the nodes where the weight gradients branch off; W
starts from those and accumulates into ``param.grad`` (views into ZeRO's flat
buffers, when sharded). Both parts together cost one ordinary backward.

The graph analysis is torch.distributed.pipelining's
(``stage_backward_input`` / ``stage_backward_weight``). Where it does not
apply, the split degrades without changing any gradient:

* a stage whose inputs need no gradient (the first stage: token ids) has no I
  to compute, so W runs the whole backward;
* with activation checkpointing the forward is recomputed inside the backward,
  which the analysis cannot see through, so I runs the whole backward and W
  has nothing left to do;
* a torch without the helpers does the same.

An input the stage passes on unchanged (a value carried to a later stage) is
also one of its outputs; its gradient is added to the input directly, outside
the analysis (which detaches the outputs it is given: it would detach that
input too, and the input's gradient would never be sent back — the cause of a
wrong tied-embedding gradient found at one unit per stage).

**Off by default; ``MPAR_SPLIT_BACKWARD=1`` turns it on.** Without it I runs
the whole backward and W has nothing left: zero-bubble schedules run in their
order and at their memory with exact gradients, but without the compute
split. With it, a GPT with tied embeddings cut one unit per stage (pp 4 x 2
virtual stages) gets exact gradients in its first step but not in later ones;
until that is understood the split stays opt-in (the case is a strict
expected-failure test).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mpar._tree import tree_leaves
from mpar.config import Config

__all__ = ["SPLIT_ENV", "split_backward"]


SPLIT_ENV = "MPAR_SPLIT_BACKWARD"
"""Set to 1 to split the backward (experimental, see above)."""


def _helpers() -> tuple[Any, Any] | None:
    if os.environ.get(SPLIT_ENV, "0").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:
        return None
    return stage_backward_input, stage_backward_weight


def split_backward(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor] | None,
    inputs: Any,
    stage: nn.Module,
    config: Config,
) -> Callable[[], None]:
    """Run I: fill the ``.grad`` of the stage's input leaves; return W."""
    leaves = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]

    def whole() -> None:
        torch.autograd.backward(roots, root_grads)

    if not leaves:
        return whole  # nothing upstream waits: all of the backward is weight work
    helpers = _helpers()
    if helpers is None or config.activation_checkpointing not in (False, "none"):
        whole()
        return _nothing
    backward_input, backward_weight = helpers
    params = [p for p in stage.parameters() if p.requires_grad]
    # An input the stage passes on unchanged (a carried value) is one of its own
    # outputs: its gradient is the received one. Kept out of the analysis, which
    # detaches the outputs it is given (and would so detach that input).
    inputs_by_id = {id(t) for t in leaves}
    grads = root_grads if root_grads is not None else [None] * len(roots)
    through = [(r, g) for r, g in zip(roots, grads) if id(r) in inputs_by_id]
    rest = [(r, g) for r, g in zip(roots, grads) if id(r) not in inputs_by_id]
    groups: Any = []
    if rest:
        rest_grads = None if root_grads is None else [g for _, g in rest]
        _, groups = backward_input([r for r, _ in rest], rest_grads, leaves, iter(params))
    for leaf, grad in through:
        if grad is not None:
            leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    return lambda: _weights(backward_weight, params, groups)


def _weights(backward_weight: Any, params: list[nn.Parameter], groups: Any) -> None:
    backward_weight(iter(params), groups)


def _nothing() -> None:
    pass
