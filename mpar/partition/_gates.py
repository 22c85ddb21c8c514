"""Unit gates: calls inserted into a traced stage's graph at its units' edges.

A traced stage (:class:`~mpar.partition._traced.TracedStage`) is one flat ATen
graph, so module hooks on its units cannot fire. :func:`gate_graph` inserts
them as calls instead. For every group ``g`` of units (in graph order):

* ``enter(gate, g, *inputs)`` right before the group's first node, over the
  tensors the group reads from outside it: ``gate.pre_forward(g)`` runs, and
  the inputs come back through an identity autograd function whose backward
  calls ``gate.post_backward(g)`` (all of the group's backward is then done);
* ``leave(gate, g, *outputs)`` right after its last node, over the tensors it
  hands to later nodes: ``gate.post_forward(g)`` runs, and the outputs come
  back through an identity function whose backward calls
  ``gate.pre_backward(g)`` before any of the group's backward runs;
* ``mark(gate, g, out)`` right after a group's output that a node *before*
  the group's end already reads (glue interleaved with the unit): the same
  backward hook, no forward hook. Every gradient that reaches the group's
  nodes therefore passes a ``pre_backward`` first;
* ``linear(gate, g, x, w, b)`` instead of ``aten.linear(x, w, b)`` where the
  weight ``w`` is a parameter that this call alone reads: it runs
  ``gate.linear(g, x, w, b)``, which may compute the weight's gradient after
  the group's backward, once its gathered parameters are freed (see
  :meth:`mpar.shard._unit_gather.UnitGather.linear`). The matrix product's backward
  would otherwise hold the gathered weight and its whole gradient at once (an
  LM head: twice the vocabulary's table).

``gate`` is read from the stage's attribute ``mpar_unit_gate`` (any object
with the four methods, and optionally ``linear``; see
:class:`mpar.shard._unit_gather.UnitGather`).
:func:`owners` says which group alone uses each parameter: parameters read
by glue or by two groups belong to none (the runtime keeps them gathered for
the whole stage).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from mpar._compat import fx
from mpar.partition._graph import _node_unit_stage, is_symbolic

__all__ = [
    "GATE_ATTR",
    "UnitGate",
    "enter",
    "gate_graph",
    "leave",
    "linear",
    "mark",
    "owners",
    "unread_in_backward",
]

GATE_ATTR = "mpar_unit_gate"

Hook = Callable[[int], None]
"""Called with a group's index."""


class UnitGate(Protocol):
    """What the generated code calls at the edges of a group (``mpar.shard``'s unit
    gather); ``linear(g, x, weight, bias)`` too where the gate has it."""

    def pre_forward(self, g: int) -> None: ...
    def post_forward(self, g: int) -> None: ...
    def pre_backward(self, g: int) -> None: ...
    def post_backward(self, g: int) -> None: ...


class _BackwardHook(torch.autograd.Function):
    """Identity; its backward calls ``hook(g)`` (a gate's ``pre_backward`` or
    ``post_backward``) before passing the gradients on."""

    @staticmethod
    def forward(ctx: Any, hook: Hook, g: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook, ctx.g = hook, g  # ctx: autograd's context object, attributes set freely
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.hook(ctx.g)
        return (None, None, *grads)


def _through(hook: Hook, g: int, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors``, those that take part in autograd passed through a :class:`_BackwardHook`."""
    picked = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not picked or not torch.is_grad_enabled():
        return tensors
    out = list(tensors)
    for i, t in zip(picked, _BackwardHook.apply(hook, g, *(tensors[i] for i in picked))):
        out[i] = t
    return tuple(out)


def enter(gate: UnitGate, g: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Before group ``g`` (called from the generated code)."""
    gate.pre_forward(g)
    return _through(gate.post_backward, g, tensors)


def leave(gate: UnitGate, g: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """After group ``g`` (called from the generated code)."""
    gate.post_forward(g)
    return _through(gate.pre_backward, g, tensors)


def mark(gate: UnitGate, g: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An output of group ``g`` read before the group ends (called from the generated code)."""
    return _through(gate.pre_backward, g, tensors)


def linear(
    gate: UnitGate, g: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``aten.linear`` in group ``g`` on a weight nothing else reads (called from the
    generated code): ``gate.linear(g, x, weight, bias)`` when the gate has it."""
    run = getattr(gate, "linear", None)
    return _LINEAR(x, weight, bias) if run is None else run(g, x, weight, bias)


# ------------------------------------------------------------------ the graph pass

_LINEAR = torch.ops.aten.linear.default


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor) and not is_symbolic(node)


def _assign(graph: fx.Graph, unit_group: Mapping[str, int]) -> dict[fx.Node, int]:
    """The group of every compute node that belongs to one (getitems follow their op)."""
    out: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, fx.Node) and source in out:
            out[node] = out[source]
            continue
        g = _node_unit_stage(node, unit_group)  # the group, here
        if g is not None:
            out[node] = g
    return out


def owners(graph: fx.Graph, groups: Sequence[Sequence[str]]) -> dict[str, int | None]:
    """``get_attr`` target -> the group that alone reads it (None: glue or several)."""
    unit_group = {name: g for g, names in enumerate(groups) for name in names}
    assign = _assign(graph, unit_group)
    out: dict[str, int | None] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        found = {assign.get(user) for user in node.users}
        target = str(node.target)
        previous = out.get(target, -1)
        group = found.pop() if len(found) == 1 else None
        out[target] = group if previous in (-1, group) else None
    return out


_WEIGHT_UNREAD_IN_BACKWARD = (torch.ops.aten.embedding.default,)
"""Ops whose gradient needs only the size of their first argument (the table):
``embedding``'s backward reads the indices and the gradient, not the weight."""


def unread_in_backward(graph: fx.Graph) -> set[str]:
    """``get_attr`` targets that every reader takes as the table of an embedding
    lookup, and nothing else: the backward never reads their values."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        if all(
            user.op == "call_function"
            and user.target in _WEIGHT_UNREAD_IN_BACKWARD
            and user.args[0] is node
            and node not in (*user.args[1:], *user.kwargs.values())
            for user in node.users
        ):
            out.add(str(node.target))
    return out


def gate_graph(graph: fx.Graph, groups: Sequence[Sequence[str]]) -> fx.Graph:
    """A copy of ``graph`` with the gates of ``groups`` (unit names per group) inserted."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    new.output(new.graph_copy(graph, env))
    output = next(n for n in new.nodes if n.op == "output")
    unit_group = {name: g for g, names in enumerate(groups) for name in names}
    assign = _assign(new, unit_group)
    if not assign:
        return new
    first_compute = next(n for n in new.nodes if n.op not in ("placeholder", "get_attr"))
    with new.inserting_before(first_compute):
        gate = new.get_attr(GATE_ATTR)
    for g in sorted(set(assign.values())):
        members = [n for n in new.nodes if assign.get(n) == g]
        order = {n: i for i, n in enumerate(new.nodes)}
        _gate_group(new, gate, g, members, order, output)
    _gate_linears(new, gate, assign)
    new.lint()
    return new


def _gate_linears(graph: fx.Graph, gate: fx.Node, assign: Mapping[fx.Node, int]) -> None:
    """``aten.linear`` calls of a group whose weight (and bias) only they read become
    :func:`linear` calls (see the module docstring)."""
    readers: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            readers[str(node.target)] = readers.get(str(node.target), 0) + len(node.users)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _LINEAR or node not in assign:
            continue
        params = [a for a in (*node.args[1:], *node.kwargs.values()) if a is not None]
        if len(node.args) >= 2 and all(
            isinstance(a, fx.Node) and a.op == "get_attr" and readers[str(a.target)] == 1
            for a in params
        ):
            node.target = linear
            node.args = (gate, assign[node], *node.args)


def _unpack(graph: fx.Graph, call: fx.Node, sources: Sequence[fx.Node]) -> list[fx.Node]:
    """getitem nodes for ``call``'s results, one per source, with the sources' metadata
    (later groups recognise them as tensors)."""
    items = []
    with graph.inserting_after(call):
        for i, source in enumerate(sources):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta = {k: v for k, v in source.meta.items() if k == "val"}
            items.append(item)
    return items


def _gate_group(
    graph: fx.Graph,
    gate: fx.Node,
    g: int,
    members: list[fx.Node],
    order: dict[fx.Node, int],
    output: fx.Node,
) -> None:
    inside = set(members)
    first, last = members[0], members[-1]
    # Inputs: tensors from outside the group that exist before it starts.
    inputs: dict[fx.Node, None] = {}
    for node in members:
        for i in node.all_input_nodes:
            if i not in inside and i.op != "get_attr" and _is_tensor(i) and order[i] < order[first]:
                inputs[i] = None
    with graph.inserting_before(first):
        call = graph.call_function(enter, (gate, g, *inputs))
    for old, new in zip(inputs, _unpack(graph, call, list(inputs))):
        for node in members:
            node.replace_input_with(old, new)
    # Outputs: the group's tensors read outside it, early (before the group ends) or late.
    late: dict[fx.Node, list[fx.Node]] = {}
    for node in members:
        if not _is_tensor(node):
            continue
        users = [u for u in node.users if u not in inside]
        early = [u for u in users if u is not output and order.get(u, -1) < order[last]]
        if early:
            with graph.inserting_after(node):
                marked = graph.call_function(mark, (gate, g, node))
            (item,) = _unpack(graph, marked, [node])
            for u in early:
                u.replace_input_with(node, item)
        rest = [u for u in users if u not in early]
        if rest:
            late[node] = rest
    with graph.inserting_after(last):
        call = graph.call_function(leave, (gate, g, *late))
    for (old, users), new in zip(late.items(), _unpack(graph, call, list(late))):
        for u in users:
            u.replace_input_with(old, new)
