"""Stage modules built from exported graphs: dynamic shapes and both train/eval modes.

The model is exported twice at split time, once in train mode and once in eval
mode (a runtime frees the parameters of other ranks' stages right after the
split, so capturing lazily later would be unsound). Each stage keeps one
generated ``forward`` function per mode over the *same* parameters, and picks
by its ``training`` flag at every call, so ``stage.train()`` / ``stage.eval()``
take effect. A stage also follows the original module: when
``module.train()`` / ``module.eval()`` changes the original's flag, each stage
adopts it at its next call. The stage interface (what a stage returns and the
next one takes) must be the same in both modes; when it is not, or a mode cannot
be exported, that mode raises a ``RuntimeError`` saying why at its first use.
"""

from __future__ import annotations

import itertools
import linecache
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpar._compat import ExportedProgram, fx, pytree, spec_child
from mpar.errors import PartitionError
from mpar.partition._capture import capture
from mpar.partition._graph import StageGraph, cut_graph

if TYPE_CHECKING:
    from sympy import Expr

    from mpar.config import BlockCheckpointing
    from mpar.partition._gates import UnitGate

__all__ = ["TracedStage", "traced_stages"]

_MODES = {True: "train", False: "eval"}
_compiled = itertools.count()


@dataclass
class _InputSpec:
    """How stage 0 flattens and checks the model's inputs in one mode."""

    in_spec: pytree.TreeSpec
    keys: list[str]
    dims: list[list[int | Expr] | None]
    """Per flat input: per axis an int, a sympy expression, or None for a non-tensor."""
    ranges: dict[Expr, tuple[int, float]]
    names: list[str]


@dataclass
class _Program:
    """One mode of one stage: a generated ``forward(self, *inputs)`` and its interface."""

    fn: Callable[..., Sequence[object]]
    """``forward(stage, *inputs)``: the stage's outputs, flat."""
    source: str
    num_inputs: int
    inputs: _InputSpec | None = None
    """Stage 0 only."""
    out_spec: pytree.TreeSpec | None = None
    """The final stage only."""
    graph: fx.Graph | None = None
    """The graph ``fn`` was generated from (without unit gates)."""
    gated: fx.Graph | None = None
    """``graph`` with unit gates, once they are installed."""


def _compile(graph: fx.Graph, name: str) -> tuple[Callable[..., Sequence[object]], str]:
    code = graph.python_code(root_module="self")
    key = f"<mpar {name} #{next(_compiled)}>"
    linecache.cache[key] = (len(code.src), None, code.src.splitlines(True), key)
    namespace = dict(code.globals)
    exec(compile(code.src, key, "exec"), namespace)  # the source fx generated from our graph
    return namespace["forward"], code.src


def _input_spec(ep: ExportedProgram, placeholders: Sequence[fx.Node]) -> _InputSpec:
    in_spec = ep.call_spec.in_spec
    assert in_spec is not None
    keys = list(spec_child(in_spec, 1).context or [])
    dims: list[list[int | Expr] | None] = []
    for p in placeholders:
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims.append([d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in val.shape])
        else:
            dims.append(None)
    ranges = {}
    for sym, vr in ep.range_constraints.items():
        upper = float(vr.upper) if vr.upper.is_finite else math.inf
        ranges[sym] = (int(vr.lower), upper)
    return _InputSpec(in_spec, keys, dims, ranges, [p.name for p in placeholders])


def _check_dims(spec: _InputSpec, leaves: Sequence[object]) -> None:
    """Raise ValueError when an input's shape is not one the graph was captured for."""
    bound: dict[Expr, int] = {}
    later: list[tuple[int, int, Expr, int]] = []
    for i, (leaf, dims) in enumerate(zip(leaves, spec.dims)):
        if dims is None:
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.dim() != len(dims):
            got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"input {spec.names[i]!r}: expected a tensor with {len(dims)} axes, got {got}"
            )
        for axis, (size, want) in enumerate(zip(leaf.shape, dims)):
            if isinstance(want, int):
                if size != want:
                    raise ValueError(_fixed_axis(spec.names[i], axis, size, want))
            elif want.is_symbol and want not in bound:
                bound[want] = int(size)
                _check_range(spec, spec.names[i], axis, want, int(size))
            else:
                later.append((i, axis, want, int(size)))
    for i, axis, want, size in later:
        expected = want.subs(bound) if want.free_symbols <= set(bound) else None
        if expected is not None and size != int(expected):
            raise ValueError(
                f"input {spec.names[i]!r} axis {axis} has size {size} but "
                f"the model needs {want} = {expected} here (from the other inputs' sizes)"
            )


def _fixed_axis(name: str, axis: int, size: int, want: int) -> str:
    return (
        f"input {name!r} axis {axis} has size {size} but the stages were captured with "
        f"{want} and this axis is fixed (the model's code pins it, or it is not among the "
        f"dynamic axes). To vary it, build the model with "
        f"mpar.DistributedModel(module, dynamic_axes=(0, {axis})) (for a sequence axis, say), "
        "or feed this size (pad to it)"
    )


def _check_range(spec: _InputSpec, name: str, axis: int, sym: Expr, size: int) -> None:
    low, high = spec.ranges.get(sym, (0, math.inf))
    if (low > 2 and size < low) or size > high:  # sizes 0 and 1 are fine, as in torch.export
        raise ValueError(
            f"input {name!r} axis {axis} has size {size} but the model only accepts "
            f"{low}..{high} on this axis"
        )


class TracedStage(nn.Module):
    """One pipeline stage cut from an exported graph; see the module docstring."""

    def __init__(self, index: int, root: nn.Module) -> None:
        super().__init__()
        self.index = index
        self.programs: dict[bool, _Program] = {}
        self.unavailable: dict[bool, str] = {}
        self.unread_in_backward: frozenset[int] = frozenset()
        """``id`` of the parameters that only embedding lookups read, in every mode
        (their gradient needs none of their values); set by :meth:`install_unit_gates`."""
        self._root = weakref.ref(root)
        self._root_training = root.training
        self.training = root.training
        self._blocks: tuple[Sequence[str], BlockCheckpointing] | None = None
        """(this stage's units, the strategy) of per-block checkpointing, else None."""

    def checkpoint_blocks(self, units: Sequence[str], strategy: BlockCheckpointing) -> None:
        """Recompute ``units`` (this stage's, in order) block by block in backward, as
        ``strategy`` chooses (:mod:`mpar.partition._block_checkpoint`); every later
        regeneration of the code (unit gates, replaced calls) keeps it."""
        self._blocks = (list(units), strategy)
        for training, program in self.programs.items():
            graph = program.gated or program.graph
            assert graph is not None
            self._regenerate(training, program, graph)

    def _regenerate(self, training: bool, program: _Program, graph: fx.Graph) -> None:
        """``program``'s code from ``graph``, its checkpointed blocks outlined."""
        mode = _MODES[training]
        if self._blocks is not None:
            from mpar.partition._block_checkpoint import checkpoint_graph

            prefix = f"mpar_block_{mode}_"
            graph, regions = checkpoint_graph(graph, *self._blocks, prefix)
            for i, region in enumerate(regions):
                object.__setattr__(self, f"{prefix}{i}", region)
        program.fn, program.source = _compile(graph, f"stage {self.index} {mode}")

    def install_unit_gates(
        self, groups: Sequence[Sequence[str]], gate: UnitGate | None
    ) -> dict[int, int | None]:
        """Regenerate every mode's code with unit gates (:mod:`mpar.partition._gates`)
        calling ``gate`` at the edges of ``groups`` (unit names per group, in
        execution order). Returns ``id(parameter) -> group`` for this stage's
        parameters: the group that alone reads it in every mode, else None.
        Also sets :attr:`unread_in_backward`."""
        from mpar.partition._gates import GATE_ATTR, gate_graph, owners, unread_in_backward

        found: dict[int, int | None] = {}
        unread: set[int] | None = None
        for training, program in self.programs.items():
            assert program.graph is not None
            ids = {id(_lookup(self, target)) for target in unread_in_backward(program.graph)}
            unread = ids if unread is None else unread & ids
            for target, group in owners(program.graph, groups).items():
                obj = _lookup(self, target)
                if isinstance(obj, nn.Parameter):
                    previous = found.get(id(obj), -1)
                    found[id(obj)] = group if previous in (-1, group) else None
            program.gated = gate_graph(program.graph, groups)
            self._regenerate(training, program, program.gated)
        object.__setattr__(self, GATE_ATTR, gate)
        for p in self.parameters():
            found.setdefault(id(p), None)
        self.unread_in_backward = frozenset(unread or ())
        return found

    def replace_calls(self, target: object, replacement: Callable[..., object]) -> int:
        """Call ``replacement`` (same arguments) wherever every mode's graph calls
        ``target``, and regenerate the code; returns how many calls were replaced.
        Nothing is replaced in a stage that has unit gates (they were generated from
        the graph before)."""
        from mpar.partition._gates import GATE_ATTR

        if hasattr(self, GATE_ATTR):
            return 0
        count = 0
        for training, program in self.programs.items():
            assert program.graph is not None
            nodes = [
                n for n in program.graph.nodes if n.op == "call_function" and n.target == target
            ]
            for node in nodes:
                node.target = replacement
            if nodes:
                self._regenerate(training, program, program.graph)
            count += len(nodes) if training else 0
        return count

    @property
    def code(self) -> str:
        """The generated source of the current mode (for debugging)."""
        return self._program().source

    def _program(self) -> _Program:
        root = self._root()
        if root is not None and root.training != self._root_training:
            self._root_training = root.training  # the original module's mode changed
            self.train(root.training)
        program = self.programs.get(self.training)
        if program is None:
            reason = self.unavailable.get(self.training, "it was not captured")
            raise RuntimeError(
                f"stage {self.index} cannot run in {_MODES[self.training]} mode: {reason}"
            )
        return program

    def forward(self, *args: object, **kwargs: object) -> object:
        program = self._program()
        inputs: Sequence[object] = args
        if program.inputs is not None:
            inputs = self._flatten(program.inputs, args, kwargs)
        elif kwargs or len(args) != program.num_inputs:
            raise TypeError(
                f"stage {self.index} takes the {program.num_inputs} outputs of stage "
                f"{self.index - 1} as positional arguments, got {len(args)} positional "
                f"and {len(kwargs)} keyword arguments"
            )
        out = program.fn(self, *inputs)
        if program.out_spec is not None:
            return pytree.tree_unflatten(list(out), program.out_spec)
        return out

    @staticmethod
    def _flatten(
        spec: _InputSpec, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> list[object]:
        if set(kwargs) != set(spec.keys):
            raise TypeError(
                f"stage 0 was traced with keyword arguments {spec.keys}, got {sorted(kwargs)}"
            )
        leaves, tree = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in spec.keys}))
        if tree != spec.in_spec:
            raise TypeError(
                f"stage 0 was traced with inputs structured as {spec.in_spec}, got {tree}"
            )
        _check_dims(spec, leaves)
        return list(leaves)


def _set_attr(root: nn.Module, target: str, obj: object, persistent: bool = True) -> None:
    *path, leaf = target.split(".")
    parent = root
    for part in path:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    if isinstance(obj, nn.Parameter):
        parent.register_parameter(leaf, obj)
    elif isinstance(obj, torch.Tensor):
        parent.register_buffer(leaf, obj, persistent=persistent)
    elif isinstance(obj, nn.Module):
        parent.add_module(leaf, obj)
    else:
        setattr(parent, leaf, obj)


def _lookup(root: nn.Module, target: str) -> object:
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _persistent_buffers(module: nn.Module) -> set[int]:
    """ids of the original module's buffers that belong in its state dict."""
    return {
        id(buf)
        for m in module.modules()
        for name, buf in m._buffers.items()
        if buf is not None and name not in m._non_persistent_buffers_set
    }


def _install(stage: TracedStage, part: StageGraph, mode: str, persistent: set[int]) -> None:
    """Register ``part``'s attributes on ``stage``, renaming clashes with the other mode.

    Buffers keep the original's persistence; constants export lifted out of the code
    are not persistent, so a stage's state dict holds only the original's entries.
    """
    for target, obj in part.attrs.items():
        existing = _lookup(stage, target)
        keep = id(obj) in persistent
        if existing is None:
            _set_attr(stage, target, obj, keep)
        elif existing is not obj:
            renamed = f"{target}_{mode}"
            _set_attr(stage, renamed, obj, keep)
            for node in part.graph.nodes:
                if node.op in ("get_attr", "call_module") and node.target == target:
                    node.target = renamed


def _interface(parts: Sequence[StageGraph]) -> list[list[tuple[torch.dtype, int]]]:
    """Per stage boundary: (dtype, rank) of every carried tensor."""
    out = []
    for part in parts[:-1]:
        assert part.outputs is not None
        out.append([(v.meta["val"].dtype, v.meta["val"].dim()) for v in part.outputs])
    return out


def _cut(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    unit_stage: Mapping[str, int],
    last: int,
    training: bool,
    dynamic_axes: Sequence[int],
) -> tuple[ExportedProgram, fx.GraphModule, list[StageGraph]]:
    ep = capture(module, args, kwargs, training=training, dynamic_axes=dynamic_axes)
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    device = tensors[0].device if tensors else None
    return ep, gm, cut_graph(gm, unit_stage, last, device)


def _check_leaves(
    ep: ExportedProgram, args: tuple[object, ...], kwargs: dict[str, object], count: int
) -> None:
    keys = list(spec_child(ep.call_spec.in_spec, 1).context or [])
    leaves = pytree.tree_leaves((args, {k: kwargs[k] for k in keys}))
    if len(leaves) != count:
        raise PartitionError(
            f"cannot split: the traced graph takes {count} inputs but the example has "
            f"{len(leaves)} leaves; pass non-tensor options as module attributes instead"
        )


def traced_stages(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    unit_stage: Mapping[str, int],
    last: int,
    dynamic_axes: Sequence[int],
) -> list[TracedStage]:
    """Export ``module`` in both modes and build ``last + 1`` stage modules."""
    stages = [TracedStage(k, module) for k in range(last + 1)]
    current = module.training
    ep, gm, parts = _cut(module, args, kwargs, unit_stage, last, current, dynamic_axes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    _check_leaves(ep, args, kwargs, len(placeholders))
    persistent = _persistent_buffers(module)
    _add_mode(stages, ep, parts, current, persistent)
    try:
        other = _cut(module, args, kwargs, unit_stage, last, not current, dynamic_axes)
    except PartitionError as exc:
        for stage in stages:
            stage.unavailable[not current] = str(exc)
        return stages
    if _interface(other[2]) != _interface(parts):
        reason = (
            f"its stages pass {_interface(other[2])} between them but the "
            f"{_MODES[current]} mode stages pass {_interface(parts)}; split the model in "
            f"{_MODES[not current]} mode to run it that way"
        )
        for stage in stages:
            stage.unavailable[not current] = reason
        return stages
    _add_mode(stages, other[0], other[2], not current, persistent)
    return stages


def _add_mode(
    stages: list[TracedStage],
    ep: ExportedProgram,
    parts: list[StageGraph],
    training: bool,
    persistent: set[int],
) -> None:
    mode = _MODES[training]
    last = len(stages) - 1
    for k, (stage, part) in enumerate(zip(stages, parts)):
        _install(stage, part, mode, persistent)
        fn, source = _compile(part.graph, f"stage {k} {mode}")
        program = _Program(fn, source, len(part.inputs), graph=part.graph)
        if k == 0:
            program.inputs = _input_spec(ep, part.inputs)
        if k == last:
            program.out_spec = ep.call_spec.out_spec
        stage.programs[training] = program
