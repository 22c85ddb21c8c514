"""Split a module into pipeline stage modules.

The contract the pipeline runtime relies on:

* stage 0 is called as ``stage0(*args, **kwargs)`` with the model's own inputs;
* every non-final stage returns a tuple, and stage ``k > 0`` is called as
  ``stage_k(*outputs_of_stage_k_minus_1)``;
* the final stage returns what ``module(*args, **kwargs)`` returns (same structure);
* stages hold the original parameter and buffer tensors (shared, not copied);
  ``SplitModel.qualnames[k]`` maps stage ``k``'s local names to the original names.

Two paths:

* a root ``nn.Sequential`` cut at its children: each stage is an ``nn.Sequential``
  of the original children under their original names (no tracing, any shape);
* anything else is captured with ``torch.export.export(strict=False)`` and the
  flat ATen graph is cut by unit: every node is attributed to a unit through its
  ``nn_module_stack``; glue outside any unit (masks, position ids, reshapes) runs
  on the stage of its first consumer; values needed later are passed through the
  stages in between. Traced stages are specialised to the example shapes (give
  one *microbatch* as the example) and to the module's train/eval mode at split
  time. Stage 0 checks its input shapes and raises on a mismatch.

Tied parameters (one tensor used by units on different stages, e.g. GPT-2's
token embedding and LM head) are *replicated by reference*: every stage that
uses the tensor holds the same ``nn.Parameter`` object, and ``SplitModel.tied``
lists the groups of ``(stage, local name)`` that are one original parameter.
In one process the gradients accumulate in the shared ``.grad``; a runtime that
places the stages in different processes must all-reduce (sum) the gradients
within each group, after which the replicas receive identical updates.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from mpar.errors import PartitionError
from mpar.partition._units import find_units

__all__ = ["SplitModel", "split_module"]


@dataclass
class SplitModel:
    """A model cut into pipeline stages; see the module docstring for the contract."""

    stages: list[nn.Module]
    """One module per stage, in pipeline order."""
    units: list[list[str]]
    """The unit names each stage runs."""
    boundaries: list[int]
    """Index of the first unit of every stage (``boundaries[0] == 0``)."""
    qualnames: list[dict[str, str]] = field(default_factory=list)
    """Per stage: local parameter/buffer name → original module's name."""
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    """Groups of ``(stage, local name)`` that are one original parameter on several stages."""
    method: str = "graph"
    """``"sequential"`` (children of an nn.Sequential) or ``"graph"`` (torch.export)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run all stages in a chain in this process (for tests and debugging)."""
        out = self.stages[0](*args, **kwargs)
        for stage in self.stages[1:]:
            out = stage(*out)
        return out


# ---------------------------------------------------------------------------
# shared helpers


def _check_boundaries(boundaries: Sequence[int], num_units: int) -> list[int]:
    starts = [int(b) for b in boundaries]
    ok = (
        bool(starts)
        and starts[0] == 0
        and all(a < b for a, b in itertools.pairwise(starts))
        and starts[-1] < num_units
    )
    if not ok:
        raise PartitionError(
            f"boundaries {list(boundaries)} are not increasing stage starts in "
            f"[0, {num_units}) beginning with 0 (one entry per stage, {num_units} units)"
        )
    return starts


def _stage_of_units(starts: Sequence[int], num_units: int) -> list[int]:
    stage_of = []
    for stage, (s, e) in enumerate(zip(starts, [*starts[1:], num_units])):
        stage_of += [stage] * (e - s)
    return stage_of


def _original_names(module: nn.Module) -> dict[int, str]:
    """id(tensor) → the original module's (first) name for every parameter and buffer."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), name)
    return names


def _local_tensors(stage: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from stage.named_parameters()
    yield from stage.named_buffers()


def _finish(
    module: nn.Module,
    stages: list[nn.Module],
    units: Sequence[str],
    starts: list[int],
    method: str,
) -> SplitModel:
    """Fill in qualnames and tied groups by tensor identity."""
    original = _original_names(module)
    qualnames: list[dict[str, str]] = []
    users: dict[int, list[tuple[int, str]]] = {}
    for k, stage in enumerate(stages):
        mapping = {}
        for local, t in _local_tensors(stage):
            if id(t) in original:
                mapping[local] = original[id(t)]
                if isinstance(t, nn.Parameter):
                    users.setdefault(id(t), []).append((k, local))
        qualnames.append(mapping)
    tied = [group for group in users.values() if len({k for k, _ in group}) > 1]
    bounds = [*starts[1:], len(units)]
    unit_lists = [list(units[s:e]) for s, e in zip(starts, bounds)]
    return SplitModel(stages, unit_lists, starts, qualnames, tied, method)


# ---------------------------------------------------------------------------
# nn.Sequential path


class _SequentialStage(nn.Sequential):
    """Children of the original Sequential; non-final stages return a 1-tuple."""

    def __init__(self, children: OrderedDict[str, nn.Module], last: bool) -> None:
        super().__init__(children)
        self.last = last

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) != 1:
            raise TypeError(
                f"a Sequential stage takes one input (what the previous child returned), "
                f"got {len(inputs)}"
            )
        out = inputs[0]
        for child in self:
            out = child(out)
        return out if self.last else (out,)


def _split_sequential(module: nn.Sequential, units: Sequence[str], starts: list[int]) -> SplitModel:
    children = dict(module.named_children())
    bounds = [*starts[1:], len(units)]
    stages: list[nn.Module] = []
    for s, e in zip(starts, bounds):
        picked = OrderedDict((name, children[name]) for name in units[s:e])
        stages.append(_SequentialStage(picked, last=e == len(units)))
    return _finish(module, stages, units, starts, "sequential")


# ---------------------------------------------------------------------------
# graph path


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return torch.export.export(module, args, kwargs, strict=False)
    except Exception as exc:  # torch.export raises many types; report them all the same way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            hint = " For Hugging Face models set config.use_cache = False."
        raise PartitionError(
            f"cannot split {type(module).__name__}: torch.export could not capture it as "
            f"one graph ({type(exc).__name__}: {first[:300]}). Remove data-dependent "
            f"control flow or graph breaks, or give an nn.Sequential.{hint}"
        ) from exc


def _node_unit_stage(node: fx.Node, unit_stage: Mapping[str, int]) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for fqn, _type in stack.values():
        if fqn in unit_stage:
            return unit_stage[fqn]
    return None


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if n.op != "get_attr"]


class _Assignment:
    """Stage of every value node of the exported graph."""

    def __init__(self, graph: fx.Graph, unit_stage: Mapping[str, int], last: int) -> None:
        self.last = last
        self.stage: dict[fx.Node, int] = {}
        self.module: dict[fx.Node, str] = {}
        nodes = _compute_nodes(graph)
        fixed = {n: _node_unit_stage(n, unit_stage) for n in nodes}
        for n in graph.nodes:
            if n.op == "placeholder":
                self.stage[n] = 0
        for n in reversed(nodes):  # glue runs where it is first needed
            if fixed[n] is not None:
                self.stage[n] = int(fixed[n])  # type: ignore[arg-type]
                continue
            consumers = [self._user_stage(u) for u in n.users]
            self.stage[n] = min(consumers) if consumers else -1
        for n in nodes:  # never before its inputs; side effects right after them
            need = max((self.stage[i] for i in _input_nodes(n)), default=0)
            if fixed[n] is None and (self.stage[n] < need or not n.users):
                self.stage[n] = need
            if n.op == "call_function" and n.target is operator.getitem:
                self.stage[n] = need  # unpack multi-output ops where they ran
        self._check(nodes, unit_stage)

    def _user_stage(self, user: fx.Node) -> int:
        return self.last if user.op == "output" else self.stage[user]

    def _check(self, nodes: Sequence[fx.Node], unit_stage: Mapping[str, int]) -> None:
        for n in nodes:
            for i in _input_nodes(n):
                if self.stage[i] > self.stage[n]:
                    raise PartitionError(
                        f"cannot split: {_where(n)} on stage {self.stage[n]} uses a value "
                        f"computed by {_where(i)} on stage {self.stage[i]}, so the stages "
                        "would not run in order. Units must be placed contiguously in "
                        "execution order; pass units=find_units(module, example_args) or "
                        "move the boundary."
                    )


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    fqns = [fqn for fqn, _ in stack.values() if fqn]
    return f"module {fqns[-1]!r} (op {node.name})" if fqns else f"op {node.name} (top level)"


def _carries(graph: fx.Graph, assign: _Assignment) -> list[list[fx.Node]]:
    """carries[k]: value nodes that stage k must return for later stages (k < last)."""
    last_use: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            continue
        for i in _input_nodes(n):
            use = assign.last if n.op == "output" else assign.stage[n]
            last_use[i] = max(last_use.get(i, 0), use)
    values = [n for n in graph.nodes if n.op not in ("get_attr", "output")]
    return [
        [v for v in values if assign.stage[v] <= k < last_use.get(v, -1)]
        for k in range(assign.last)
    ]


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _build_stage(
    gm: fx.GraphModule,
    assign: _Assignment,
    k: int,
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node] | None,
) -> fx.GraphModule:
    """Stage ``k`` as a GraphModule: placeholders ``inputs``; returns ``outputs`` or the model output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    for v in inputs:
        env[v] = graph.placeholder(v.name)

    def lookup(n: fx.Node) -> fx.Node:
        if n.op == "get_attr" and n not in env:
            attrs[str(n.target)] = _get_attr(gm, str(n.target))
            env[n] = graph.get_attr(str(n.target))
        return env[n]

    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or assign.stage[n] != k:
            continue
        if n.op == "call_module":
            attrs[str(n.target)] = gm.get_submodule(str(n.target))
        env[n] = graph.node_copy(n, lookup)
    if outputs is None:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        graph.output(fx.map_arg(out_node.args[0], lookup))
    else:
        graph.output(tuple(env[v] for v in outputs))
    graph.lint()
    return fx.GraphModule(attrs, graph, class_name=f"Stage{k}")


class _FlattenInputs:
    """Forward pre-hook of traced stage 0: model inputs → the graph's flat placeholders."""

    def __init__(self, in_spec: pytree.TreeSpec, shapes: list[Any]) -> None:
        self.in_spec = in_spec
        self.shapes = shapes

    def __call__(self, _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs_spec = self.in_spec.child(1)
        keys = list(kwargs_spec.context) if kwargs_spec.context else []
        if set(kwargs) != set(keys):
            raise TypeError(
                f"stage 0 was traced with keyword arguments {keys}, got {sorted(kwargs)}"
            )
        leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in keys}))
        if spec != self.in_spec:
            raise TypeError(
                f"stage 0 was traced with inputs structured as {self.in_spec}, got {spec}"
            )
        for i, (leaf, shape) in enumerate(zip(leaves, self.shapes)):
            if isinstance(leaf, torch.Tensor) and tuple(leaf.shape) != shape:
                raise ValueError(
                    f"input {i} has shape {tuple(leaf.shape)} but the stages were traced "
                    f"with {shape}; split with an example of one microbatch"
                )
        return tuple(leaves), {}


class _UnflattenOutputs:
    """Forward hook of the traced final stage: flat leaves → the model's output structure."""

    def __init__(self, out_spec: pytree.TreeSpec) -> None:
        self.out_spec = out_spec

    def __call__(self, _mod: nn.Module, _args: Any, output: Any) -> Any:
        return pytree.tree_unflatten(list(output), self.out_spec)


def _orphans(
    module: nn.Module, stages: list[nn.Module], units: Sequence[str], stage_of: list[int]
) -> None:
    """Attach parameters the graph never touched to their unit's stage (else the last)."""
    present = {id(t) for st in stages for _, t in _local_tensors(st)}
    unit_index = {name: i for i, name in enumerate(units)}
    for name, param in module.named_parameters():
        if id(param) in present:
            continue
        owner = next(
            (u for u in unit_index if u == "" or name == u or name.startswith(u + ".")), None
        )
        stage = stages[stage_of[unit_index[owner]] if owner is not None else -1]
        *path, leaf = name.split(".")
        parent = stage
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, param)


def _split_graph(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    units: Sequence[str],
    starts: list[int],
) -> SplitModel:
    ep = _export(module, args, kwargs)
    gm = ep.module()
    stage_of = _stage_of_units(starts, len(units))
    params_of = {name: any(True for _ in module.get_submodule(name).parameters()) for name in units}
    unit_stage = {name: stage_of[i] for i, name in enumerate(units) if params_of[name]}
    last = len(starts) - 1
    assign = _Assignment(gm.graph, unit_stage, last)
    carries = _carries(gm.graph, assign)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    stages: list[nn.Module] = []
    for k in range(last + 1):
        inputs = placeholders if k == 0 else carries[k - 1]
        stages.append(_build_stage(gm, assign, k, inputs, None if k == last else carries[k]))
    _install_io_hooks(stages, ep, args, kwargs, len(placeholders))
    _orphans(module, stages, units, stage_of)
    return _finish(module, stages, units, starts, "graph")


def _install_io_hooks(
    stages: list[nn.Module], ep: Any, args: tuple[Any, ...], kwargs: dict[str, Any], count: int
) -> None:
    in_spec = ep.call_spec.in_spec
    keys = list(in_spec.child(1).context or [])
    leaves, _ = pytree.tree_flatten((args, {k: kwargs[k] for k in keys}))
    if len(leaves) != count:
        raise PartitionError(
            f"cannot split: the traced graph takes {count} inputs but the example has "
            f"{len(leaves)} leaves; pass non-tensor options as module attributes instead"
        )
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves]
    stages[0].register_forward_pre_hook(_FlattenInputs(in_spec, shapes), with_kwargs=True)
    stages[-1].register_forward_hook(_UnflattenOutputs(ep.call_spec.out_spec))


# ---------------------------------------------------------------------------


def split_module(
    module: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
    boundaries: Sequence[int],
    *,
    units: Sequence[str] | None = None,
) -> SplitModel:
    """Cut ``module`` into ``len(boundaries)`` stage modules.

    Args:
        module: the model; its parameters are shared with the stages, not copied.
        example_args, example_kwargs: one microbatch of inputs (shapes are baked in
            for traced models).
        boundaries: index of the first unit of every stage, starting with 0.
        units: unit names in execution order; default ``find_units(module, example_args,
            example_kwargs)``.

    Returns:
        A ``SplitModel``; ``split(*args, **kwargs)`` runs the chain in-process.

    Raises:
        PartitionError: bad boundaries, a model torch.export cannot capture, or a
            placement that is not contiguous in execution order.
    """
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    if units is None:
        units = find_units(module, args, kwargs)
    units = list(units)
    starts = _check_boundaries(boundaries, len(units))
    children = [name for name, _ in module.named_children()]
    if isinstance(module, nn.Sequential) and units == children and not kwargs:
        return _split_sequential(module, units, starts)
    return _split_graph(module, args, kwargs, units, starts)
