"""Cut one exported ATen graph into per-stage ``fx.Graph``s (pure fx, no modules run).

Every compute node is attributed to a unit through its ``nn_module_stack``;
glue outside any unit (masks, position ids, reshapes) runs on the stage of its
first consumer; values needed later are passed through the stages in between
(the *carries*).

Symbolic sizes (``sym_size``, and arithmetic on sizes, from dynamic shapes)
are never carried: stages exchange tensors only. Each stage recomputes the sizes
it uses, preferably from the shape of a tensor it already receives (the batch
size from the hidden state, say); when none of its inputs has the size, the
smallest way to get it is carried instead: the model input that has it, or the
tensor it was read from.

Devices: export writes the device of the example into ops that create tensors
(``torch.arange(n, device=x.device)`` becomes ``arange(n, device="cpu")``).
Every such device equal to the example's becomes the device of the stage's
first input at run time, so stages split on the CPU run wherever they and their
inputs are moved.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mpar._compat import fx
from mpar.errors import PartitionError

if TYPE_CHECKING:
    from sympy import Expr
    from torch.fx.node import Argument

__all__ = ["StageGraph", "cut_graph", "is_symbolic"]

_SIZE = torch.ops.aten.sym_size.int
_LATER_CALL = re.compile(r"@\d+$")


def is_symbolic(node: fx.Node) -> bool:
    """Whether ``node`` computes a symbolic size (an int/bool/float, not a tensor)."""
    val = node.meta.get("val")
    return node.op == "call_function" and isinstance(
        val, (torch.SymInt, torch.SymFloat, torch.SymBool)
    )


def _expr(node: fx.Node) -> Expr:
    return node.meta["val"].node.expr


def _dim_exprs(node: fx.Node) -> list[Expr | None]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    return [d.node.expr if isinstance(d, torch.SymInt) else None for d in val.shape]


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    ops = ("call_function", "call_method", "call_module")
    return [n for n in graph.nodes if n.op in ops and not is_symbolic(n)]


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if n.op != "get_attr" and not is_symbolic(n)]


def _sym_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if is_symbolic(n)]


def _node_unit_stage(node: fx.Node, unit_stage: Mapping[str, int]) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for fqn, _type in stack.values():
        if fqn in unit_stage:
            return unit_stage[fqn]
    return None


def _in_later_call(node: fx.Node, unit_stage: Mapping[str, int]) -> bool:
    """Whether ``node`` belongs to a later call of its unit (export's stack key ``...@1``:
    a module the forward calls again further on, its weights shared)."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, (fqn, _type) in stack.items():
        if fqn in unit_stage:
            return _LATER_CALL.search(key) is not None
    return False


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    fqns = [fqn for fqn, _ in stack.values() if fqn]
    return f"module {fqns[-1]!r} (op {node.name})" if fqns else f"op {node.name} (top level)"


class _Symbols:
    """Which tensors each symbolic size must be read from."""

    def __init__(self, graph: fx.Graph) -> None:
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.global_exprs: dict[Expr, tuple[fx.Node, int]] = {}
        for p in self.placeholders:
            for d, e in enumerate(_dim_exprs(p)):
                if e is not None and e.is_symbol:
                    self.global_exprs.setdefault(e, (p, d))
        self._roots: dict[fx.Node, frozenset[fx.Node]] = {}

    def is_global(self, size: fx.Node) -> bool:
        """A size that is a dimension of a model input: every stage can get it."""
        return size.target is _SIZE and _expr(size) in self.global_exprs

    def roots(self, node: fx.Node) -> frozenset[fx.Node]:
        """Tensors a symbolic node needs (none for sizes of the model inputs)."""
        if node not in self._roots:
            if self.is_global(node):
                found: frozenset[fx.Node] = frozenset()
            else:
                found = frozenset(_tensor_inputs(node))
                for s in _sym_inputs(node):
                    found |= self.roots(s)
            self._roots[node] = found
        return self._roots[node]


class _Assignment:
    """Stage of every (non-symbolic) value node of the exported graph."""

    def __init__(
        self, graph: fx.Graph, unit_stage: Mapping[str, int], last: int, symbols: _Symbols
    ) -> None:
        self.last = last
        self.symbols = symbols
        self.stage: dict[fx.Node, int] = {}
        nodes = _compute_nodes(graph)
        fixed = {n: _node_unit_stage(n, unit_stage) for n in nodes}
        # A unit called again later (a block applied twice, weights shared) runs that
        # call where its inputs are: on its own stage or a later one, which then holds
        # its parameters too (tied by reference, gradients summed across ranks).
        later = {n for n in nodes if _in_later_call(n, unit_stage)}
        for n in graph.nodes:
            if n.op == "placeholder":
                self.stage[n] = 0
        for n in reversed(nodes):  # glue runs where it is first needed
            if fixed[n] is not None:
                self.stage[n] = int(fixed[n])  # type: ignore[arg-type]
                continue
            consumers = [self._user_stage(u) for u in n.users if not is_symbolic(u)]
            self.stage[n] = min(consumers) if consumers else -1
        for n in nodes:  # never before its inputs; side effects right after them
            need = max((self.stage[i] for i in self.needs(n)), default=0)
            floats = fixed[n] is None or n in later
            if floats and (self.stage[n] < need or (fixed[n] is None and not n.users)):
                self.stage[n] = need
            if n.op == "call_function" and n.target is operator.getitem:
                self.stage[n] = need  # unpack multi-output ops where they ran
        self._check(nodes)

    def needs(self, node: fx.Node) -> list[fx.Node]:
        """Tensor nodes ``node`` reads, directly or through symbolic sizes."""
        found = list(_tensor_inputs(node))
        for s in _sym_inputs(node):
            found += self.symbols.roots(s)
        return found

    def _user_stage(self, user: fx.Node) -> int:
        return self.last if user.op == "output" else self.stage[user]

    def _check(self, nodes: Sequence[fx.Node]) -> None:
        for n in nodes:
            for i in self.needs(n):
                if self.stage[i] > self.stage[n]:
                    raise PartitionError(
                        f"cannot split: {_where(n)} on stage {self.stage[n]} uses a value "
                        f"computed by {_where(i)} on stage {self.stage[i]}, so the stages "
                        "would not run in order. Units must be placed contiguously in "
                        "execution order; pass units=find_units(module, example_args) or "
                        "move the boundary."
                    )


def _carries(
    graph: fx.Graph, assign: _Assignment, extra: Mapping[fx.Node, int]
) -> list[list[fx.Node]]:
    """carries[k]: tensor nodes that stage k must return for later stages (k < last)."""
    last_use: dict[fx.Node, int] = dict(extra)
    for n in graph.nodes:
        if n.op == "get_attr" or is_symbolic(n):
            continue
        for i in _tensor_inputs(n):
            use = assign.last if n.op == "output" else assign.stage[n]
            last_use[i] = max(last_use.get(i, 0), use)
    values = [n for n in graph.nodes if n in assign.stage]
    return [
        [v for v in values if assign.stage[v] <= k < last_use.get(v, -1)]
        for k in range(assign.last)
    ]


def _used_symbols(nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """Symbolic nodes ``nodes`` read, with the symbolic nodes those read, in graph order."""
    seen: dict[fx.Node, None] = {}
    todo = [s for n in nodes for s in _sym_inputs(n)]
    while todo:
        s = todo.pop()
        if s not in seen:
            seen[s] = None
            todo += _sym_inputs(s)
    return list(seen)


class _SizePlan:
    """For every stage: where each symbolic size it uses is read from."""

    def __init__(self, graph: fx.Graph, assign: _Assignment, carries: list[list[fx.Node]]):
        self.sources: list[dict[fx.Node, tuple[fx.Node, int]]] = []
        self.missing: list[tuple[fx.Node, int]] = []
        placeholders = assign.symbols.placeholders
        for k in range(assign.last + 1):
            inputs = placeholders if k == 0 else carries[k - 1]
            local = [n for n in graph.nodes if assign.stage.get(n) == k]
            if k == assign.last:
                local += [n for n in graph.nodes if n.op == "output"]
            self.sources.append(self._plan_stage(assign, k, inputs, local))

    def _plan_stage(
        self, assign: _Assignment, k: int, inputs: Sequence[fx.Node], local: Sequence[fx.Node]
    ) -> dict[fx.Node, tuple[fx.Node, int]]:
        have = set(inputs) | set(local)
        sources: dict[fx.Node, tuple[fx.Node, int]] = {}
        for s in _used_symbols(local):
            if s.target is not _SIZE:
                self._require(assign, k, [t for t in _tensor_inputs(s) if t not in have])
                continue
            tensor = s.args[0]
            if tensor in have:
                continue
            found = _find_dim(inputs, _expr(s))
            if found is not None:
                sources[s] = found
            elif assign.symbols.is_global(s):
                self._require(assign, k, [assign.symbols.global_exprs[_expr(s)][0]])
            else:
                self._require(assign, k, [tensor])  # type: ignore[list-item]
        return sources

    def _require(self, assign: _Assignment, k: int, tensors: Sequence[fx.Node]) -> None:
        for t in tensors:
            if assign.stage[t] > k:
                raise PartitionError(
                    f"cannot split: stage {k} needs the size of {_where(t)}, which is "
                    f"computed later, on stage {assign.stage[t]}; move the boundary"
                )
            self.missing.append((t, k))


def _find_dim(tensors: Sequence[fx.Node], expr: Expr) -> tuple[fx.Node, int] | None:
    for t in tensors:
        for d, e in enumerate(_dim_exprs(t)):
            if e is not None and e == expr:
                return t, d
    return None


@dataclass
class StageGraph:
    """One stage of a cut graph."""

    graph: fx.Graph
    attrs: dict[str, object]
    """get_attr target → object (parameters, buffers, constants, submodules)."""
    inputs: list[fx.Node]
    """The original graph's nodes this stage takes, in order (placeholders for stage 0)."""
    outputs: list[fx.Node] | None
    """The original graph's nodes this stage returns; None for the final stage."""


def _device_of(tensor: torch.Tensor) -> torch.device:
    """The device of a stage's first input (called from the generated code)."""
    return tensor.device


def _get_attr(root: torch.nn.Module, target: str) -> object:
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _StageBuilder:
    """Copies stage ``k``'s nodes, recomputing the symbolic sizes it uses."""

    def __init__(
        self,
        gm: fx.GraphModule,
        assign: _Assignment,
        k: int,
        inputs: Sequence[fx.Node],
        sources: Mapping[fx.Node, tuple[fx.Node, int]],
        device: torch.device | None,
    ) -> None:
        self.gm, self.sources = gm, sources
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.attrs: dict[str, object] = {}
        for v in inputs:
            self.env[v] = self.graph.placeholder(v.name)
            self.env[v].meta = dict(v.meta)
        tensors = [v for v in inputs if isinstance(v.meta.get("val"), torch.Tensor)]
        self.device = device if tensors else None
        self.first_input = self.env[tensors[0]] if tensors else None
        self.device_node: fx.Node | None = None
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method", "call_module") and assign.stage.get(n) == k:
                if n.op == "call_module":
                    self.attrs[str(n.target)] = gm.get_submodule(str(n.target))
                self.env[n] = self.graph.node_copy(n, self.lookup)
                self._follow_device(self.env[n])

    def _follow_device(self, node: fx.Node) -> None:
        """Replace the example's device in ``node``'s arguments by the first input's."""
        if self.device is None:
            return
        found = [a for a in (*node.args, *node.kwargs.values()) if a == self.device]
        if not found:
            return
        if self.device_node is None:
            with self.graph.inserting_after(self.first_input):
                self.device_node = self.graph.call_function(_device_of, (self.first_input,))

        def swap(a: Argument) -> Argument:
            return self.device_node if isinstance(a, torch.device) and a == self.device else a

        node.args = tuple(swap(a) for a in node.args)
        node.kwargs = {key: swap(a) for key, a in node.kwargs.items()}

    def lookup(self, n: fx.Node) -> fx.Node:
        if n in self.env:
            return self.env[n]
        if n.op == "get_attr":
            self.attrs[str(n.target)] = _get_attr(self.gm, str(n.target))
            self.env[n] = self.graph.get_attr(str(n.target))
        elif n in self.sources:
            tensor, dim = self.sources[n]
            self.env[n] = self.graph.call_function(_SIZE, (self.lookup(tensor), dim))
            self.env[n].meta = dict(n.meta)
        elif is_symbolic(n):
            self.env[n] = self.graph.node_copy(n, self.lookup)
        else:  # pragma: no cover - the assignment and the carries guarantee availability
            raise PartitionError(f"internal error: {_where(n)} is not available on this stage")
        return self.env[n]

    def finish(self, gm_output: fx.Node | None, outputs: Sequence[fx.Node] | None) -> fx.Graph:
        if outputs is None:
            assert gm_output is not None
            self.graph.output(fx.map_arg(gm_output.args[0], self.lookup))
        else:
            self.graph.output(tuple(self.env[v] for v in outputs))
        self.graph.lint()
        return self.graph


def cut_graph(
    gm: fx.GraphModule,
    unit_stage: Mapping[str, int],
    last: int,
    device: torch.device | None = None,
) -> list[StageGraph]:
    """Cut ``gm`` (from ``ExportedProgram.module()``) into ``last + 1`` stage graphs.

    ``unit_stage`` maps the qualified name of every unit that holds parameters to its
    stage. Stage 0 takes the graph's placeholders; stage ``k > 0`` takes stage
    ``k - 1``'s outputs; the final stage returns the graph's (flat) output.
    ``device``: the example's device, made to follow each stage's first input.
    """
    graph = gm.graph
    assign = _Assignment(graph, unit_stage, last, _Symbols(graph))
    extra: dict[fx.Node, int] = {}
    while True:  # carry the tensors some stage must read a size from, until none is missing
        carries = _carries(graph, assign, extra)
        plan = _SizePlan(graph, assign, carries)
        if not plan.missing:
            break
        before = dict(extra)
        for t, k in plan.missing:
            extra[t] = max(extra.get(t, 0), k)
        if extra == before:  # pragma: no cover - carrying a tensor always makes it available
            raise PartitionError("internal error: symbolic sizes cannot be placed on stages")
    output = next(n for n in graph.nodes if n.op == "output")
    stages = []
    for k in range(last + 1):
        inputs = assign.symbols.placeholders if k == 0 else carries[k - 1]
        outputs = None if k == last else carries[k]
        builder = _StageBuilder(gm, assign, k, inputs, plan.sources[k], device)
        stage_graph = builder.finish(output if k == last else None, outputs)
        stages.append(StageGraph(stage_graph, builder.attrs, list(inputs), outputs))
    return stages
