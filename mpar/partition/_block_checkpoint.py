"""Per-block activation checkpointing: which blocks, and how a block is recomputed.

``activation_checkpointing: "block"`` (``"selective"``, ``{"mode": ..., "every": k}``;
:class:`mpar.config.BlockCheckpointing`) checkpoints the partition units of every
stage one by one, as FSDP users and torchtitan checkpoint each transformer block:
a checkpointed block keeps its inputs (and, selectively, its matrix products'
outputs) through the forward and recomputes the rest inside its own backward, so
only one block's activations exist at a time during the backward.

* A stage that keeps the original modules (``pipeline_parallel_degree`` 1) runs
  each chosen unit module's ``forward`` through :func:`checkpoint_call`
  (``mpar.runtime._recompute``).
* A traced stage (one flat graph) gets :func:`checkpoint_graph`: each chosen
  unit's span of nodes (between the ZeRO unit gates at its edges, when the stage
  has them) is moved into a function of its own, called through
  :func:`run_region`. Parameters stay outside the function (they are passed in,
  as the ``Parameter`` objects whose storage ZeRO-3 frees and gathers in place).

Recomputation is ``torch.utils.checkpoint`` (non-reentrant, RNG state restored,
so dropout draws the same masks). Under ZeRO-3 a block's backward starts with
its unit gate's ``pre_backward``, which gathers the unit again before the
recomputation reads its parameters, and its ``post_backward`` frees them: the
recomputed forward runs on parameters gathered for the backward, as with FSDP,
and no gather runs inside a recomputation (the gates stay outside the checkpointed
span; on a stage that is the model itself they are module hooks around the
checkpointed ``forward``).
A module that updates state in its forward (batch norm's running statistics)
updates it again when recomputed, as with ``torch.utils.checkpoint`` itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from mpar._compat import fx

if TYPE_CHECKING:
    from mpar.config import BlockCheckpointing

__all__ = [
    "KEPT_OPS",
    "Region",
    "checkpoint_call",
    "checkpoint_graph",
    "chosen_units",
    "run_region",
    "selective_policy",
]

_aten = torch.ops.aten
KEPT_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
"""Ops whose outputs selective checkpointing keeps (expensive to recompute, cheap
to store); a batched product larger than both its operands is recomputed instead
(:func:`selective_policy`)."""

_BATCHED = (_aten.bmm.default, _aten.baddbmm.default)


def _scores(a: object, b: object) -> bool:
    """Whether the batched product ``a @ b`` outnumbers both of its operands (attention
    scores: sequence x sequence per head, from q and k of sequence x head size)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2:
        return False
    out = a.numel() // max(1, a.shape[-1]) * b.shape[-1]
    return out > max(a.numel(), b.numel())


def selective_policy(
    _ctx: object, op: object, *args: object, **_kwargs: object
) -> CheckpointPolicy:
    """Keep the outputs of :data:`KEPT_OPS`, recompute everything else; attention
    scores (a batched product whose result outnumbers both operands) are recomputed."""
    if op not in KEPT_OPS or (op in _BATCHED and _scores(args[-2], args[-1])):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _selective_contexts() -> tuple[ContextManager[None], ContextManager[None]]:
    """``checkpoint``'s ``context_fn`` for the selective mode."""
    return create_selective_checkpoint_contexts(selective_policy)


def checkpoint_call(
    fn: Callable[..., object],
    selective: bool,
    *args: object,
    **kwargs: Any,  # fn's own keywords, passed through checkpoint()
) -> object:
    """``fn(*args, **kwargs)`` checkpointed (selectively: keeping :data:`KEPT_OPS`'
    outputs) when autograd records, else plainly."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if not selective:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)


def chosen_units(units: Sequence[str], strategy: BlockCheckpointing) -> list[str]:
    """The units of one stage (in order) that ``strategy`` checkpoints."""
    return [u for i, u in enumerate(units) if strategy.checkpoints(i)]


# ------------------------------------------------------------------ traced stages


@dataclass
class Region:
    """One checkpointed span of a traced stage's graph, as a function of its inputs."""

    fn: Callable[..., Sequence[object]]
    """``forward(None, *inputs)``: the span's outputs, a tuple."""
    source: str
    selective: bool


def run_region(region: Region, *inputs: object) -> Sequence[object]:
    """The span's outputs, recomputed in backward (called from the generated code)."""
    out = checkpoint_call(region.fn, region.selective, None, *inputs)
    assert isinstance(out, tuple)  # the generated function returns a tuple
    return out


def _spans(graph: fx.Graph, units: Sequence[str]) -> list[tuple[int, int]]:
    """``(first, last)`` node positions of each unit's nodes (units named ``""`` are
    skipped); overlapping spans merged. The unit gates before and after a unit stay
    outside its span: no gather or reduction runs inside a recomputation."""
    from mpar.partition._gates import _assign

    nodes = list(graph.nodes)
    where = _assign(graph, {u: i for i, u in enumerate(units) if u})
    spans: list[tuple[int, int]] = []
    for i in range(len(units)):
        members = [k for k, n in enumerate(nodes) if where.get(n) == i]
        if members:
            spans.append((members[0], members[-1]))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _outline(
    graph: fx.Graph, span: list[fx.Node], selective: bool
) -> tuple[Region, list[fx.Node], list[fx.Node]]:
    """The span as a :class:`Region`; its inputs and outputs in ``graph``."""
    inside = set(span)
    inputs: dict[fx.Node, None] = {}
    for node in span:
        for i in node.all_input_nodes:
            if i not in inside:
                inputs[i] = None
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in inputs:
        env[i] = sub.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for node in span:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in outputs))
    code = sub.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, "<mpar checkpointed block>", "exec"), namespace)  # fx's own code
    return Region(namespace["forward"], code.src, selective), list(inputs), outputs


def _replace_span(graph: fx.Graph, span: list[fx.Node], attr: str, mode: str) -> Region:
    """Replace ``span`` in ``graph`` by ``run_region(self.<attr>, *inputs)``."""
    region, inputs, outputs = _outline(graph, span, mode == "selective")
    with graph.inserting_before(span[0]):
        holder = graph.get_attr(attr)
        call = graph.call_function(run_region, (holder, *inputs))
    with graph.inserting_after(call):
        items = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
    inside = set(span)
    for old, item in zip(outputs, items):
        item.meta = dict(old.meta)
        old.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for node in reversed(span):
        graph.erase_node(node)
    return region


def checkpoint_graph(
    graph: fx.Graph, units: Sequence[str], strategy: BlockCheckpointing, prefix: str
) -> tuple[fx.Graph, list[Region]]:
    """A copy of ``graph`` whose chosen units (:func:`chosen_units` of ``units``, the
    stage's units in order) run as checkpointed regions: each span becomes
    ``run_region(self.<prefix><i>, *inputs)``; returns the graph and its regions, to
    be set as the stage's attributes ``<prefix><i>``."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    new.output(new.graph_copy(graph, env))
    chosen = set(chosen_units(units, strategy))
    picked = [u if u in chosen else "" for u in units]  # "": not checkpointed
    nodes = list(new.nodes)
    regions: list[Region] = []
    for lo, hi in _spans(new, picked):
        span = [n for n in nodes[lo : hi + 1] if n.op not in ("get_attr", "placeholder")]
        for n in nodes[lo : hi + 1]:
            if n.op == "get_attr" and span:  # no inputs: it can go before the span
                span[0].prepend(n)
        if span:
            region = _replace_span(new, span, f"{prefix}{len(regions)}", strategy.mode)
            regions.append(region)
    new.lint()
    return new, regions
