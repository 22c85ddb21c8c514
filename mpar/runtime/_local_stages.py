"""Deciding and building this rank's pipeline stages.

Rank 0 of the job profiles the model on one microbatch and solves the
partition (or reads the manual placement); the boundaries are broadcast so
every rank splits the model identically, keeps the stages it owns, and frees
the parameters of the others.

What the partition plans for is :func:`planner_inputs`: the one translation of the
run's config (``mpar.partition.plan_inputs``) on this job's grid and device, the
record ``mpar plan`` and the ``"auto"`` search read too.

Under tensor parallelism the profile is of the whole model (the layout is applied
after the partition, before the split) and the partition is solved on one TP rank's
share of it (``mpar.partition._tp_share.tp_share``): what the layout splits in each unit is
read from the checked layout and one forward of the whole model, as ``mpar plan --tp``
reads it (``mpar.tensor_parallel.measure_tp_splits``); nothing of the layout runs before
the split.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpar import _device
from mpar.comm import State
from mpar.comm._collectives import broadcast_object_world
from mpar.comm._ep_ops import BATCH_GROUP, EP_GROUP
from mpar.comm._tp_ops import TP_GROUP
from mpar.errors import PartitionError
from mpar.expert_parallel import EPLayout, apply_ep_layout, install_router_aux
from mpar.runtime._precision import cast_floats, compute_dtype
from mpar.tensor_parallel import TPLayout, apply_layout

if TYPE_CHECKING:
    from mpar.config import Config
    from mpar.partition import CPAttention, Plan, PlanInputs
    from mpar.partition._ep_share import EPSplits
    from mpar.partition._tp_share import TPSplits
    from mpar.profile import ModelProfile
    from mpar.topology import Grid

__all__ = ["LocalStages", "build_local_stages", "planner_inputs"]


@dataclass
class LocalStages:
    """The stages of the whole model, and which of them this rank runs."""

    num_stages: int
    modules: dict[int, nn.Module]
    """Stage index -> stage module, only for stages on this rank."""
    qualnames: dict[int, dict[str, str]]
    """Stage index -> (local name -> original name), only for stages on this rank."""
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    plan: Plan | None = None
    unit_names: list[list[str]] = field(default_factory=list)
    tied_groups: list[tuple[Any, nn.Parameter]] = field(default_factory=list)
    """(process group, local parameter) for tied parameters whose copies live on other ranks."""
    tp_size: int = 1
    """Ranks of the tensor-parallel group that split these stages' layers."""
    tp_split: frozenset[int] = frozenset()
    """``id`` of every parameter tensor parallelism split (the rest are replicated over TP)."""
    expert_params: frozenset[int] = frozenset()
    """``id`` of every parameter of this rank's experts under expert parallelism (their
    gradients and ZeRO state live on the expert-data-parallel group)."""
    checkpointed: dict[int, list[str]] = field(default_factory=dict)
    """Stage index -> the units recomputed block by block (per-block activation
    checkpointing), only for stages on this rank."""


def planner_inputs(
    config: Config,
    grid: Grid,
    device: torch.device,
    tp_splits: TPSplits | None = None,
    ep_splits: EPSplits | None = None,
    cp_attention: CPAttention | None = None,
) -> PlanInputs:
    """What the partition and the ``"auto"`` search plan for: ``config`` on this job's
    ``grid`` (``ProcessGrid.topology``) and ``device``, with the model's TP splits (what
    its experts weigh under expert parallelism) and, under context parallelism, where it
    attends. Where no attention was measured (the runtime refuses such a model at its
    first step) the CP ranks are planned as data parallel ones: the same sharding, no
    attention traffic."""
    from mpar.partition import plan_inputs
    from mpar.partition._plan_inputs import plan_device

    kind = plan_device(device.type)
    inputs = plan_inputs(config, grid.shape, device=kind, tp_splits=tp_splits, ep_splits=ep_splits)
    shape = inputs.grid
    if shape.cp == 1:
        return inputs
    if cp_attention is None or not cp_attention.found:
        folded = dataclasses.replace(shape, dp=shape.dp * shape.cp, cp=1)
        return dataclasses.replace(inputs, grid=folded)
    return dataclasses.replace(inputs, cp_attention=cp_attention)


def cp_attention_of(
    module: nn.Module,
    profile: ModelProfile,
    example: tuple[tuple[object, ...], dict[str, object]],
    grid: Grid,
    profiled_cp: int,
) -> CPAttention | None:
    """Under context parallelism, where the profiled model attends (else None)."""
    if grid.cp_size == 1:
        return None
    from mpar.context_parallel import measure_cp_attention

    return measure_cp_attention(module, profile, example, profiled_cp)


def _decide_boundaries(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    units: list[str],
    st: State,
    tp: TPLayout | None = None,
    ep: EPLayout | None = None,
    profiled_cp: int = 1,
) -> tuple[list[int], Plan | None]:
    from mpar.expert_parallel import measure_ep_splits
    from mpar.partition import make_plan, manual_boundaries
    from mpar.profile import profile_mode, profile_model
    from mpar.tensor_parallel import measure_tp_splits

    cfg = st.config
    num_stages = cfg.num_stages
    if len(units) < num_stages:
        raise PartitionError(
            f"the model has {len(units)} partitionable units ({units}) but the configuration "
            f"asks for {num_stages} stages (pipeline_parallel_degree {cfg.pipeline_parallel_degree}"
            f" x virtual_stages {cfg.virtual_stages}); lower one of them"
        )
    if not cfg.auto_partition:
        boundaries = manual_boundaries(module, units, default=cfg.default_partition)
        if len(boundaries) != num_stages:
            raise PartitionError(
                f"manual placement (auto_partition false) puts the model's units on "
                f"{len(boundaries)} stage(s), 0 to {len(boundaries) - 1}, but the configuration "
                f"has {num_stages} (pipeline_parallel_degree {cfg.pipeline_parallel_degree} x "
                f"virtual_stages {cfg.virtual_stages}): attach modules inside "
                f"`with mpar.partition(i):` blocks for every stage 0 to {num_stages - 1}, or "
                "set auto_partition true"
            )
        return boundaries, None
    # A meta model, or one that does not fit this rank's device_memory, is profiled
    # from FLOPs on fake tensors: nothing runs for real.
    mode = profile_mode(module, cfg.device_memory)
    profile = profile_model(module, args, kwargs, units=units, repeats=3, warmup=1, mode=mode)
    module.zero_grad(set_to_none=True)
    splits = None if tp is None else measure_tp_splits(module, profile, tp, (args, kwargs))
    experts = None
    if ep is not None:
        experts = measure_ep_splits(module, profile, (args, kwargs), plan=cfg.ep_plan)
    grid = st.grid.topology
    attention = cp_attention_of(module, profile, (args, kwargs), grid, profiled_cp)
    inputs = planner_inputs(cfg, grid, st.device, splits, ep_splits=experts, cp_attention=attention)
    plan = make_plan(profile, inputs)
    return list(plan.boundaries), plan


@contextmanager
def _parameters_in(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Floating-point parameters temporarily in ``dtype`` (mixed precision's compute dtype).

    Stages are captured with the dtypes they will run in: a model that converts
    dtypes itself (a norm computing in float32 and casting back to its input's
    dtype) is traced into explicit casts, which must be the mixed-precision ones.
    The original values come back untouched afterwards.
    """
    if dtype is None:
        yield
        return
    saved = [(p, p.data) for p in module.parameters() if p.is_floating_point()]
    for p, data in saved:
        p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def _free_unowned(module: nn.Module, kept: list[nn.Module]) -> None:
    """Release the storage of every parameter and buffer no kept stage uses."""
    keep = {id(t) for m in kept for t in list(m.parameters()) + list(m.buffers())}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) not in keep:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _has_meta(module: nn.Module) -> bool:
    from mpar.meta import has_meta

    return has_meta(module)


def _module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters (else buffers) are; the CPU if it has none."""
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


def build_local_stages(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    st: State,
    *,
    dynamic_axes: Sequence[int] = (0,),
    tp: TPLayout | None = None,
    ep: EPLayout | None = None,
    capture_whole: bool = False,
    profiled_cp: int = 1,
) -> LocalStages:
    """Partition ``module`` (identically on every rank) and keep this rank's stages;
    traced stages accept any size of the ``dynamic_axes`` of their inputs. With a
    tensor-parallel layout ``tp`` (an expert-parallel layout ``ep``), the model is
    profiled and partitioned whole, then made this rank's TP share (its experts' share)
    before it is split into stages. ``capture_whole``: one stage is captured as a graph
    too (context parallelism replaces calls in it), not run as the module itself.
    ``profiled_cp``: the CP degree the example's sequences are cut by already (the
    first step's: ``cp``; example inputs: 1)."""
    num_stages = st.config.num_stages
    meta = _has_meta(module)  # tensors get storage later, on this rank's share only
    if num_stages == 1 and not capture_whole:
        return _one_stage(module, st, meta=meta, tp=tp, ep=ep)
    from mpar.meta import find_units_meta
    from mpar.partition import find_units, split_module
    from mpar.profile import preserved_state, profile_mode

    # The whole model is traced, profiled and split where the user built it (the
    # host, usually: it need not fit on one device); only the stages move.
    args, kwargs = _device.to_device((args, kwargs), _module_device(module))
    if meta or profile_mode(module, st.config.device_memory) == "meta":  # nothing runs
        units = find_units_meta(module, args, kwargs)
    else:
        with torch.no_grad(), preserved_state(module):
            units = find_units(module, args, kwargs)
    units = _experts_whole(units, ep)
    if num_stages == 1:  # one stage captured whole (context parallelism): nothing to decide
        boundaries, plan = [0], None
    else:
        boundaries, plan = _agreed_boundaries(module, args, kwargs, units, st, tp, ep, profiled_cp)
    tp_split = _apply_tp(module, tp, st)  # profiled whole; split as this rank's TP share
    experts = _apply_ep(module, ep, st)  # and its experts' share
    dtype = compute_dtype(st.config)
    with preserved_state(module), _parameters_in(module, dtype):
        args, kwargs = cast_floats((args, kwargs), dtype)
        split = split_module(
            module, args, kwargs, boundaries, units=units, dynamic_axes=dynamic_axes
        )
    home = _placement(st)
    mine = {s: split.stages[s] for s in range(num_stages) if home(s) == st.grid.pp_rank}
    _free_unowned(module, list(mine.values()))
    for stage in mine.values():
        if not meta:
            _device.move_module(stage, st.device)
    return LocalStages(
        num_stages=num_stages,
        modules=mine,
        qualnames={s: split.qualnames[s] for s in mine},
        tied=split.tied,
        plan=plan,
        unit_names=split.units,
        tied_groups=_tied_groups(split.tied, mine, st),
        tp_size=st.grid.tp_size,
        tp_split=tp_split,
        expert_params=experts,
    )


def _one_stage(
    module: nn.Module, st: State, *, meta: bool, tp: TPLayout | None, ep: EPLayout | None
) -> LocalStages:
    """No pipeline: the whole model is the one stage (this rank's TP and experts' share)."""
    tp_split = _apply_tp(module, tp, st)
    experts = _apply_ep(module, ep, st)
    if not meta:
        _device.move_module(module, st.device)
    names = {n: n for n, _ in list(module.named_parameters()) + list(module.named_buffers())}
    return LocalStages(
        1,
        {0: module},
        {0: names},
        unit_names=[["<whole model>"]],
        tp_size=st.grid.tp_size,
        tp_split=tp_split,
        expert_params=experts,
    )


def _agreed_boundaries(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    units: list[str],
    st: State,
    tp: TPLayout | None,
    ep: EPLayout | None,
    profiled_cp: int,
) -> tuple[list[int], Plan | None]:
    """Rank 0 decides the stage boundaries (and the plan) and every rank gets them; a
    failure there is raised on every rank (none waits for a decision that never comes)."""
    decision: Any = None
    if st.layout.rank == 0:
        try:
            decided = _decide_boundaries(module, args, kwargs, units, st, tp, ep, profiled_cp)
            decision = ("ok", *decided)
        except Exception as exc:
            decision = ("error", exc, None)
    decision = broadcast_object_world(decision, st.grid, src=0)
    if decision[0] == "error":
        raise decision[1]
    return decision[1], decision[2]


def _apply_ep(module: nn.Module, ep: EPLayout | None, st: State) -> frozenset[int]:
    """Make ``module`` this rank's share of its experts (and, over data parallelism, its
    router balance loss the one of the whole batch); the ids of its expert parameters."""
    if st.grid.dp_size > 1:
        install_router_aux(module, BATCH_GROUP)
    if ep is None:
        return frozenset()
    before = _expert_tensors(module, ep)
    apply_ep_layout(module, ep, st.grid.ep_rank, EP_GROUP)
    kept = {id(t) for t in _expert_tensors(module, ep)}
    for tensor in before:  # other ranks' experts: a reference the user keeps (the torch
        if id(tensor) not in kept:  # optimizer's param_groups) must not keep them alive
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return frozenset(id(p) for name in ep.experts for p in module.get_submodule(name).parameters())


def _experts_whole(units: list[str], ep: EPLayout | None) -> list[str]:
    """``units`` with the units inside an experts module (a ``ModuleList`` of experts is
    expanded into one unit per expert) replaced by that module: no stage boundary falls
    between one layer's experts, which the expert-parallel forward runs as one."""
    if ep is None:
        return units
    out: dict[str, None] = {}
    for unit in units:
        holder = next((name for name in ep.experts if unit.startswith(name + ".")), unit)
        out.setdefault(holder, None)
    return list(out)


def _expert_tensors(module: nn.Module, ep: EPLayout) -> list[torch.Tensor]:
    """The parameters and buffers of ``module``'s experts modules."""
    mods = [module.get_submodule(name) for name in ep.experts]
    return [t for m in mods for t in [*m.parameters(), *m.buffers()]]


def _apply_tp(module: nn.Module, tp: TPLayout | None, st: State) -> frozenset[int]:
    """Make ``module`` this rank's TP share; the ids of the parameters split."""
    if tp is None:
        return frozenset()
    apply_layout(module, tp, st.grid.tp_rank, TP_GROUP)
    return frozenset(id(p) for name, p in module.named_parameters() if name in tp.shards)


def _placement(st: State) -> Callable[[int], int]:
    """Stage -> pipeline rank, as the configured schedule places stages."""
    from mpar.schedule import placement_of, stage_rank

    placement = placement_of(st.config.pipeline)
    num_stages, pp = st.config.num_stages, st.grid.pp_size
    return lambda s: stage_rank(s, num_stages, pp, placement)


def _tied_groups(
    tied: list[list[tuple[int, str]]], mine: dict[int, nn.Module], st: State
) -> list[tuple[Any, nn.Parameter]]:
    """Process groups summing the gradients of parameters tied across ranks."""
    grid, out, home = st.grid, [], _placement(st)
    for group in tied:
        pp_ranks = sorted({home(s) for s, _ in group})
        if len(pp_ranks) < 2:
            continue  # every copy is the same Parameter object on one rank
        here = (grid.dp_rank, grid.tp_rank, grid.cp_rank)
        for d, t, c in itertools.product(  # every rank creates every group, in order
            range(grid.dp_size), range(grid.tp_size), range(grid.cp_size)
        ):
            handle = grid.new_group([grid.rank_of(p, d, t, c) for p in pp_ranks])
            if (d, t, c) != here or grid.pp_rank not in pp_ranks:
                continue
            s, name = next((s, n) for s, n in group if s in mine)
            out.append((handle, mine[s].get_parameter(name)))
    return out
