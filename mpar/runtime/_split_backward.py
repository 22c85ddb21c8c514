"""The backward of one stage split in two: input gradients now (I), weights later (W).

``split_backward`` runs the I part and returns the W part as a function. I
walks autograd from the stage's outputs (or its loss) back to its inputs
only, so the previous stage gets its gradient as early as possible, and keeps
the gradients that reach the nodes where the weight gradients branch off; W
starts from those and accumulates into ``param.grad`` (views into ZeRO's flat
buffers, when sharded). Both parts together cost one ordinary backward.

The graph analysis is torch.distributed.pipelining's (``_backward.py``:
``get_param_groups`` finds the nodes where weight paths join the input's
path, ``stage_backward_weight`` is W). I is written here rather than taken
from ``stage_backward_input`` for two reasons found in testing:

* **Outputs that do not depend on the stage's inputs.** The analysis only
  keeps weight paths that join the input's path; an output computed from
  weights alone (a position embedding ``wpe(arange(T))`` that a stage
  returns for the next one to add) is never reached from the inputs, so its
  weight gradient was silently lost (found with TinyGPT cut one unit per
  stage: ``wpe`` never learned, so losses matched in the first step and
  drifted from the second on). Such outputs are all weight work: W
  backpropagates them whole, before the groups.
* **Outputs that are views.** ``stage_backward_input`` detaches its outputs
  in place, which torch refuses for views (a stage ending in ``reshape``).
  Here the outputs are left alone; their graph goes when the executor drops
  them.

A value the stage passes on unchanged (a carried input, also one of its
outputs) depends on the input trivially and takes the same path as any
other output. Where the analysis does not apply, the split degrades without
changing any gradient:

* a stage whose inputs need no gradient (the first stage: token ids) has no I
  to compute, so W runs the whole backward;
* with activation checkpointing the forward is recomputed inside the backward,
  which the analysis cannot see through, so I runs the whole backward and W
  has nothing left to do;
* so does a torch without the helpers, or ``MPAR_SPLIT_BACKWARD=0``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mpar._tree import tree_leaves
from mpar.config import Config

__all__ = ["SPLIT_ENV", "split_backward", "split_enabled"]


SPLIT_ENV = "MPAR_SPLIT_BACKWARD"
"""Set to 0 to run the whole backward in I (W empty): an escape hatch, same gradients."""


def split_enabled() -> bool:
    """Whether I/W actions split the backward (on unless ``MPAR_SPLIT_BACKWARD=0``)."""
    return os.environ.get(SPLIT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _torch_analysis() -> Any:
    if not split_enabled():
        return None
    try:
        from torch.distributed.pipelining import _backward
    except ImportError:
        return None
    needed = (
        "_get_grad_fn_or_grad_acc",
        "construct_reverse_graph",
        "reverse_closure",
        "get_param_groups",
        "stage_backward_weight",
    )
    return _backward if all(hasattr(_backward, n) for n in needed) else None


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
    analysis = _torch_analysis()
    if analysis is None or config.activation_checkpointing not in (False, "none"):
        whole()
        return _nothing
    params = [p for p in stage.parameters() if p.requires_grad]
    grads = list(root_grads) if root_grads is not None else [torch.ones_like(r) for r in roots]
    weight_only, groups = _backward_input(analysis, roots, grads, leaves, params)
    return lambda: _weights(analysis, params, groups, weight_only)


def _backward_input(
    analysis: Any,
    roots: list[torch.Tensor],
    grads: list[torch.Tensor],
    leaves: list[torch.Tensor],
    params: list[nn.Parameter],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[dict[str, Any]]]:
    """I: the input leaves' gradients; returns what W needs (weight-only roots
    with their gradients, and the parameter groups with the gradients that
    reached their intermediate nodes)."""
    node_of = analysis._get_grad_fn_or_grad_acc
    root_nodes = [node_of(r) for r in roots]
    reverse = analysis.construct_reverse_graph(root_nodes)
    input_nodes = [node_of(t) for t in leaves]
    reached, _ = analysis.reverse_closure(input_nodes, set(), reverse)
    through = [(r, g) for r, g, n in zip(roots, grads, root_nodes) if n in reached]
    weight_only = [(r, g) for r, g, n in zip(roots, grads, root_nodes) if n not in reached]
    param_nodes = [node_of(p) for p in params]
    groups = analysis.get_param_groups(input_nodes, param_nodes, reverse)
    handles = []
    try:
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            for i, node in enumerate(group["intermediates"]):
                handles.append(node.register_prehook(_keeper(group, i)))
        if through:
            dinputs = torch.autograd.grad(
                [r for r, _ in through],
                leaves,
                [g for _, g in through],
                retain_graph=True,  # W walks the weight branches from the kept nodes
                allow_unused=True,
            )
            for leaf, grad in zip(leaves, dinputs):
                if grad is not None:
                    leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    finally:
        for handle in handles:
            handle.remove()
    return weight_only, groups


def _keeper(group: dict[str, Any], i: int) -> Callable[[Any], None]:
    """A pre-hook keeping the gradient that reaches ``group``'s ``i``-th intermediate."""

    def keep(grad_outputs: Any) -> None:
        if group.get("grads") is None:
            group["grads"] = [None] * len(group["intermediates"])
        group["grads"][i] = grad_outputs

    return keep


def _weights(
    analysis: Any,
    params: list[nn.Parameter],
    groups: list[dict[str, Any]],
    weight_only: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """W: outputs made from weights alone first (their graph may share nodes with
    the groups' branches, which the groups' pass frees), then the groups."""
    if weight_only:
        torch.autograd.backward(
            [r for r, _ in weight_only], [g for _, g in weight_only], retain_graph=bool(groups)
        )
        weight_only.clear()
    groups = [g for g in groups if g.get("grads") is not None]
    if groups:
        analysis.stage_backward_weight(iter(params), groups)


def _nothing() -> None:
    pass
