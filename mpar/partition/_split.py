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
  flat ATen graph is cut by unit (``_graph``): every node is attributed to a unit
  through its ``nn_module_stack``; glue outside any unit (masks, position ids,
  reshapes) runs on the stage of its first consumer; values needed later are
  passed through the stages in between; stages exchange tensors only (symbolic
  sizes are recomputed on each stage).

Traced stages (``_traced.TracedStage``) accept any size of the ``dynamic_axes``
(default: the batch axis 0 of every tensor input) that the model allows, so
microbatches of different sizes, a short last batch and evaluation batches run
through the same stages. The model is captured in train and in eval mode, and
each stage runs the graph of its current mode: ``stage.train()`` /
``stage.eval()`` (or ``module.train()`` / ``module.eval()`` on the original)
switch dropout and the like, with the parameters shared by both graphs. Stage 0
checks its inputs' shapes against the captured graph and names the input and
axis on a mismatch.

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
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpar.errors import PartitionError
from mpar.partition._traced import _set_attr, traced_stages
from mpar.profile._units import find_units

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

    def __call__(self, *args: object, **kwargs: object) -> object:
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

    def forward(self, *inputs: object) -> object:
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


def _orphans(
    module: nn.Module, stages: Sequence[nn.Module], units: Sequence[str], stage_of: list[int]
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
        _set_attr(stage, name, param)


# Hugging Face's output-capturing hooks (transformers 5: router logits, attentions,
# hidden states) hand a module's output to the same forward's return value, dataflow
# the capture records like any other: nothing to refuse or warn of.
_HF_OUTPUT_CAPTURE = "transformers.utils.output_capturing"


def _hooked(module: nn.Module, *kinds: str) -> list[str]:
    """The modules of ``module`` (by name) with any hook of the ``kinds`` attributes."""
    return [
        name or type(module).__name__
        for name, m in module.named_modules()
        if any(
            getattr(hook, "__module__", None) != _HF_OUTPUT_CAPTURE
            for kind in kinds
            for hook in getattr(m, kind).values()
        )
    ]


def _check_hooks(module: nn.Module) -> None:
    """Module hooks in a model that is captured as a graph: backward hooks are refused
    (export records the forward only, so they would never run, and a hook that changes
    gradients would train another model silently); forward hooks get a warning."""
    backward = _hooked(module, "_backward_hooks", "_backward_pre_hooks")
    if backward:
        raise PartitionError(
            f"modules {backward[:5]} have backward hooks (register_full_backward_hook / "
            "register_full_backward_pre_hook), which a model cut into stages by torch.export "
            "never calls; remove them (change gradients in the loss, or in the parameters' "
            "`.grad` after the step and before the optimizer's step)"
        )
    forward = _hooked(module, "_forward_hooks", "_forward_pre_hooks")
    if forward:
        warnings.warn(
            f"modules {forward[:5]} have forward hooks: the stages are captured with them, "
            "so what they return is applied at every step, but their other effects "
            "(logging, counters) happen only while the model is captured; hooks added "
            "after the first step are not called",
            stacklevel=3,
        )


def _split_graph(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    units: Sequence[str],
    starts: list[int],
    dynamic_axes: Sequence[int],
) -> SplitModel:
    _check_hooks(module)
    stage_of = _stage_of_units(starts, len(units))
    params_of = {name: any(True for _ in module.get_submodule(name).parameters()) for name in units}
    unit_stage = {name: stage_of[i] for i, name in enumerate(units) if params_of[name]}
    last = len(starts) - 1
    stages = traced_stages(module, args, kwargs, unit_stage, last, dynamic_axes)
    _orphans(module, stages, units, stage_of)
    return _finish(module, list(stages), units, starts, "graph")


# ---------------------------------------------------------------------------


def split_module(
    module: nn.Module,
    example_args: Sequence[object],
    example_kwargs: Mapping[str, object] | None,
    boundaries: Sequence[int],
    *,
    units: Sequence[str] | None = None,
    dynamic_axes: Sequence[int] = (0,),
) -> SplitModel:
    """Cut ``module`` into ``len(boundaries)`` stage modules.

    Args:
        module: the model; its parameters are shared with the stages, not copied.
        example_args, example_kwargs: one microbatch of inputs. Sizes other than the
            ``dynamic_axes`` are fixed for traced models.
        boundaries: index of the first unit of every stage, starting with 0.
        units: unit names in execution order; default ``find_units(module, example_args,
            example_kwargs)``.
        dynamic_axes: axes of every tensor input whose size may change from call to
            call in traced stages: ``(0,)`` the batch (default), ``(0, 1)`` also the
            sequence, ``()`` none. Ignored for ``nn.Sequential`` (any shape works).

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
    return _split_graph(module, args, kwargs, units, starts, tuple(dynamic_axes))
