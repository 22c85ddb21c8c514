"""``make_plan``: a partition and memory plan from a profile, before anything runs.

What the run is comes in one record, :class:`mpar.partition.PlanInputs` (built from
a ``Config`` by ``plan_inputs``); what the plan assumes of the hardware in a
``CostModel``.

Stages are laid out looped, as in Megatron-LM: with ``p`` ranks and ``v``
virtual stages there are ``p * v`` stages and stage ``s`` runs on rank
``s % p`` as its chunk ``s // p`` (zbv: in a V).

Memory per stage is its share of a rank's *peak* (``mpar.partition._memory_model``):
parameters, gradients and optimizer state of its units by ZeRO stage, precision
and offload (tied replicas included), saved activations per microbatch in
flight on its rank (from the schedule's ``peak_in_flight``, spread evenly
over the rank's chunks; one microbatch's with activation checkpointing), and
``extra_bytes``: kept boundary tensors, pipeline message buffers (counted from
the schedule, ``mpar.partition._prediction.message_counts``), the ZeRO-2/3 working
set, a gradient bucket and, on the last stage, the loss; each rank adds its
process's memory besides tensors (``CostModel.process_bytes``). ``device_memory``
caps a rank; the solver caps each of its ``v`` stages at
``(device_memory - process) / v`` (less a reserve for the cut-dependent extras) and
the exact figures are reported.

Communication: a stage that is not the last sends its last unit's output on
in the forward pass and receives the gradient of the same size back, so it
costs ``comm = 2 * output_bytes / link_bandwidth`` seconds per microbatch
(``CostModel.link_bandwidth`` in bytes per second, default 10 GB/s; None leaves
communication out). The solver adds it to the stage's compute (see
``solve(comm=...)``), so cuts land where activations are small when the times
allow.

Predicted step time and bubble come from simulating the schedule with the
profiled stage times (``mpar.partition._prediction``); ``step_time_s`` adds
``overhead_s``: the busiest rank's data-parallel sync and offload time per step
(``mpar.partition._cost``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar, cast

from mpar.errors import PartitionError
from mpar.partition._cost import CostModel, step_overhead_s
from mpar.partition._cp_share import cp_comm_s, cp_share
from mpar.partition._ep_share import ep_comm_s, ep_share
from mpar.partition._memory_model import (
    MemoryLayout,
    MessageCounts,
    boundary_bytes,
    loss_bytes,
    optimizer_step_bytes,
    recompute_peak_bytes,
    stage_extra_bytes,
    unit_held_bytes,
    unit_host_bytes,
    unit_state_bytes,
    working_set_for_solver,
)
from mpar.partition._methods import parameter_boundaries, uniform_boundaries
from mpar.partition._plan_report import Plan, StagePlan
from mpar.partition._prediction import (
    in_flight_per_rank,
    message_counts,
    predict,
    split_backward_gain,
)
from mpar.partition._solver import (
    DeferredError,
    _fmt,
    memory_weight_for,
    solve,
    stage_costs,
)
from mpar.partition._tp_share import tp_comm_s, tp_share

if TYPE_CHECKING:
    from mpar.partition._plan_inputs import PlanInputs
    from mpar.profile import ModelProfile, UnitProfile

__all__ = [
    "Laid",
    "Method",
    "UnitCache",
    "lay_out",
    "make_plan",
    "moe_layers",
    "process_bytes",
    "rank_overheads",
    "unit_memory",
    "unit_time",
]

Method = Literal["profile", "uniform", "parameters"]
_METHODS = ("profile", "uniform", "parameters")


def make_plan(
    profile: ModelProfile,
    inputs: PlanInputs,
    *,
    cost: CostModel | None = None,
    method: Method = "profile",
    microbatch_scale: float = 1.0,
    microbatch_size: int | None = None,
) -> Plan:
    """Partition a profiled model for the run ``inputs`` describes and predict its cost.

    Args:
        profile: from ``mpar.profile.profile_model`` (one microbatch of the whole model).
        inputs: the run: grid, schedule, ZeRO, precision, checkpointing, device and its
            memory, objective, TP splits (``mpar.partition.plan_inputs`` builds it from
            a ``Config``). With ``grid.tp > 1`` the figures are one TP rank's and each
            unit's time gains its TP collectives over ``cost.tp_bandwidth``.
        cost: bandwidths and speed factors (``CostModel``; its ``link_bandwidth``
            prices each cut, ``2 * output_bytes / link_bandwidth`` per microbatch).
        method: "profile" (optimal on profiled time and memory, under
            ``device_memory``), "uniform" (equal units) or "parameters" (equal
            parameter counts).
        microbatch_scale: samples per microbatch over the profiled microbatch's.
        microbatch_size: samples per microbatch, only reported.
    """
    cost = cost or CostModel()
    share = _cp_profile(_ep_profile(_tp_profile(profile, inputs), inputs), inputs)
    _check(share, inputs, method)
    laid = lay_out(share, inputs, cost=cost, microbatch_scale=microbatch_scale, method=method)
    makespan, bubble = predict(laid.stages, inputs, cost)
    overhead = max(rank_overheads(laid.stages, inputs, laid.layout, cost, share.units))
    grid, s, cap = inputs.grid, inputs.schedule, inputs.device_memory
    splits = inputs.tp_splits
    return Plan(
        laid.stages,
        laid.starts,
        grid.pp,
        s.virtual_stages,
        s.microbatches,
        s.pipeline,
        method,
        laid.weight,
        cap,
        makespan + overhead,
        bubble,
        _bind(laid, None if cap is None else cap / s.virtual_stages),
        laid.rank_memory,
        True,
        cost.link_bandwidth,
        overhead_s=overhead,
        process_bytes=int(process_bytes(grid.pp, cost, laid.layout, moe_layers(inputs))),
        host_memory_bytes=laid.host_memory,
        optimizer_step_bytes=laid.optimizer_step,
        microbatch_size=microbatch_size,
        layout=laid.layout,
        tensor_parallel_degree=grid.tp,
        tp_bandwidth=cost.tp_bandwidth if grid.tp > 1 else None,
        tp_comm_bytes=tp_step_bytes(laid.stages, share.units, laid.layout, inputs),
        tp_source=splits.source if grid.tp > 1 and splits is not None else "",
        split_backward_gain=split_backward_gain(laid.stages, inputs, cost),
        expert_parallel_degree=grid.ep,
        ep_bandwidth=cost.ep_bandwidth if grid.ep > 1 else None,
        ep_comm_bytes=ep_step_bytes(laid.stages, share.units, laid.layout, inputs),
        context_parallel_degree=grid.cp,
        context_parallel_method=inputs.context_parallel_method if grid.cp > 1 else "",
        cp_bandwidth=cost.cp_bandwidth if grid.cp > 1 else None,
        cp_comm_bytes=cp_step_bytes(laid.stages, share.units, laid.layout, inputs),
    )


def _tp_profile(profile: ModelProfile, inputs: PlanInputs) -> ModelProfile:
    """One TP rank's share of ``profile`` (``profile`` itself at tp = 1)."""
    tp = inputs.grid.tp
    if tp == 1:
        return profile
    if inputs.tp_splits is None:
        raise PartitionError(
            f"tensor_parallel_degree {tp} needs tp_splits in the plan inputs (what the "
            "model's TP plan splits, from mpar.tensor_parallel.measure_tp_splits)"
        )
    return tp_share(profile, inputs.tp_splits, tp)


def _ep_profile(profile: ModelProfile, inputs: PlanInputs) -> ModelProfile:
    """One ep rank's share of ``profile`` (``profile`` itself at ep = 1)."""
    ep = inputs.grid.ep
    if ep == 1:
        return profile
    if inputs.ep_splits is None:
        raise PartitionError(
            f"expert_parallel_degree {ep} needs ep_splits in the plan inputs (what the "
            "model's experts weigh, from mpar.expert_parallel.measure_ep_splits)"
        )
    return ep_share(profile, inputs.ep_splits, ep, inputs.grid.dp)


def _cp_profile(profile: ModelProfile, inputs: PlanInputs) -> ModelProfile:
    """One CP rank's share of ``profile`` (one TP rank's; itself at cp = 1)."""
    cp = inputs.grid.cp
    if cp > 1 and inputs.cp_attention is None:
        raise PartitionError(
            f"context_parallel_degree {cp} needs cp_attention in the plan inputs (where the "
            "model attends, from mpar.partition.measure_attention)"
        )
    method = inputs.context_parallel_method
    return cp_share(profile, inputs.cp_attention, cp, method, inputs.grid.tp)


def _check(profile: ModelProfile, inputs: PlanInputs, method: str) -> None:
    p, v = inputs.grid.pp, inputs.schedule.virtual_stages
    if method not in _METHODS:
        raise PartitionError(f"method must be one of {', '.join(_METHODS)}; got {method!r}")
    if len(profile.units) < p * v:
        raise PartitionError(
            f"{p} ranks x {v} virtual stages = {p * v} stages but the model "
            f"has only {len(profile.units)} units; lower pipeline_parallel_degree or "
            "virtual_stages"
        )


@dataclass
class Laid:
    """A partition with per-stage figures, before the schedule is simulated."""

    starts: list[int]
    stages: list[StagePlan]
    layout: MemoryLayout
    """The memory model's knobs the figures were computed with."""
    weight: float
    """The memory weight the solver used."""
    memory: list[float]
    comm: list[float] | None
    compute: list[float]
    rank_memory: list[int]
    host_memory: list[int] = field(default_factory=list)
    optimizer_step: list[int] = field(default_factory=list)


def lay_out(
    profile: ModelProfile,
    inputs: PlanInputs,
    *,
    cost: CostModel,
    microbatch_scale: float = 1.0,
    method: str = "profile",
    cache: UnitCache | None = None,
) -> Laid:
    """Partition for one run and compute every stage's memory and time (no simulation).

    ``profile`` is one TP rank's (``tp_share``) of one CP rank's (``cp_share``); the cap
    is ``inputs.device_memory``. ``cache``: per-unit figures shared with other layouts
    of the same profile (the search's)."""
    p, s, layout = inputs.grid.pp, inputs.schedule, inputs.memory_layout(microbatch_scale)
    v, m, k = s.virtual_stages, s.microbatches, s.active_microbatches
    flight = list(in_flight_per_rank(p, v, m, s.pipeline, k))
    messages = message_counts(p, v, m, s.pipeline, k)
    units, cache = profile.units, cache or UnitCache()
    held = cache.get(("state", id(units), layout), lambda: static_unit_memory(units, layout))
    memory, reserve = unit_memory(units, layout, max(flight), messages, held)
    process = process_bytes(p, cost, layout, moe_layers(inputs))
    cap_rank, weight = (
        inputs.device_memory,
        memory_weight_for(inputs.optimize, inputs.memory_weight),
    )
    cap = None if cap_rank is None else max((cap_rank - process) / v - reserve, 0.0)
    key = ("time", id(units), microbatch_scale, layout.precision, cost)
    comm, tp, cp, compute = cache.get(key, lambda: _unit_times(units, layout, cost))
    try:
        starts = _boundaries(profile, method, p * v, memory, weight, cap, comm, compute)
    except PartitionError as exc:
        if cap_rank is None:
            raise

        solver = exc  # ``exc`` is unbound when the except block ends

        def why() -> str:  # composed only when read (the search reads none)
            parts = reserve_parts(units, layout, max(flight), messages)
            return f"{solver}. {_cap_note(cap_rank, process, v, parts)}"

        raise DeferredError(why) from None
    home = _placement(s.pipeline, p * v, p)
    stages = _stage_plans(units, starts, home, flight, layout, comm, compute, messages, tp, cp)
    step = optimizer_step(stages, units, layout, p)
    rank_memory = [
        int(process)
        + sum(s.state_bytes for s in stages if s.rank == r)
        + max(sum(s.memory_bytes - s.state_bytes for s in stages if s.rank == r), step[r])
        for r in range(p)
    ]
    host = host_memory(stages, units, layout, p)
    return Laid(starts, stages, layout, weight, memory, comm, compute, rank_memory, host, step)


UnitTimes = tuple[list[float] | None, list[float], list[float], list[float]]
"""Per unit: pipeline transfer, TP and EP collective, CP attention traffic and total
seconds of one microbatch (``_unit_times``)."""


def _unit_times(units: Sequence[UnitProfile], layout: MemoryLayout, cost: CostModel) -> UnitTimes:
    comm = _comm(units, layout, cost.link_bandwidth)
    scale = layout.microbatch_scale * layout.dtype_factor
    tp = [
        tp_comm_s(u, scale, cost.tp_bandwidth) + ep_comm_s(u, scale, cost.ep_bandwidth)
        for u in units
    ]
    cp = [
        cp_comm_s(u, layout.microbatch_scale, layout.dtype_factor, cost.cp_bandwidth) for u in units
    ]
    compute = [unit_time(u, layout, cost) + t + c for u, t, c in zip(units, tp, cp)]
    return comm, tp, cp, compute


_T = TypeVar("_T")


class UnitCache:
    """Per-unit figures many layouts share, kept by one search: each unit's state and
    ZeRO working set per memory layout, and its seconds per microbatch size and
    precision (the layouts that differ only in schedule, virtual stages or pipeline
    degree reuse them). Keys name the profile's units by identity: a cache serves the
    profiles that stay alive while it does (the search's, one per parallel degree)."""

    def __init__(self) -> None:
        self._store: dict[tuple[object, ...], object] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[object, ...], make: Callable[[], _T]) -> _T:
        """The value kept under ``key``, made by ``make()`` the first time."""
        if key in self._store:
            self.hits += 1
            return cast(_T, self._store[key])
        self.misses += 1
        value = self._store[key] = make()
        return value


def unit_time(unit: UnitProfile, layout: MemoryLayout, cost: CostModel) -> float:
    """Seconds of one microbatch of the layout's size: the per-sample part scales."""
    k, speed = layout.microbatch_scale, cost.mixed_speedup if layout.mixed else 1.0
    return (unit.fixed_time_s + (unit.time_s - unit.fixed_time_s) * k) / speed


def _tied_replicas(units: Sequence[UnitProfile], names: set[str]) -> int:
    """State bytes of tied parameters a stage holds whose owner is on another stage."""
    extra: dict[str, int] = {}
    for unit in units:
        for owner, nbytes in unit.tied_state_bytes.items():
            if owner not in names:
                extra[owner] = max(extra.get(owner, 0), nbytes)
    return sum(extra.values())


def _comm(
    units: Sequence[UnitProfile], layout: MemoryLayout, bandwidth: float | None
) -> list[float] | None:
    """Per unit: seconds to send its output on and its gradient back, per microbatch."""
    if bandwidth is None:
        return None
    return [2 * boundary_bytes(u, layout) / bandwidth for u in units]


def _boundaries(
    profile: ModelProfile,
    method: str,
    num_stages: int,
    memory: Sequence[float],
    weight: float,
    cap: float | None,
    comm: Sequence[float] | None,
    compute: Sequence[float],
) -> list[int]:
    if method == "uniform":
        return uniform_boundaries(len(profile.units), num_stages)
    if method == "parameters":
        return parameter_boundaries([u.param_count for u in profile.units], num_stages)
    return solve(
        compute,
        num_stages,
        memory=memory,
        memory_weight=weight,
        memory_cap=cap,
        comm=comm,
        names=profile.names,
    )


def unit_memory(
    units: Sequence[UnitProfile],
    layout: MemoryLayout,
    in_flight: int,
    transfers: Sequence[MessageCounts] = (),
    static: StaticMemory | None = None,
) -> tuple[list[float], float]:
    """Per-unit memory for the solver, and the bytes to reserve below the cap
    (``static``: ``static_unit_memory(units, layout)``, computed when not given).

    Additive parts go to the units (states, saved activations per microbatch in
    flight or one microbatch's recomputed ones, the loss on the last unit, the ZeRO
    working set when it is gathered by chunk); what depends on where the cuts fall
    (kept boundary tensors, message buffers, the ZeRO working set by unit or group)
    is bounded by the largest boundary and units and reserved from the cap.
    """
    states, working, working_reserve = static or static_unit_memory(units, layout)
    memory = [
        state + unit_held_bytes(u, layout, in_flight) + w
        for u, state, w in zip(units, states, working)
    ]
    memory[-1] += loss_bytes(units[-1], layout, in_flight)
    return memory, _reserve(units, layout, in_flight, transfers, working_reserve).total


StaticMemory = tuple[list[float], list[float], float]
"""Per unit: state bytes and ZeRO working set for the solver; the working set's reserve
(what a layout's memory needs whatever its schedule)."""


def static_unit_memory(units: Sequence[UnitProfile], layout: MemoryLayout) -> StaticMemory:
    """The schedule-independent part of :func:`unit_memory`."""
    working, reserve = working_set_for_solver(units, layout)
    return [unit_state_bytes(u, layout) for u in units], working, reserve


@dataclass(frozen=True)
class Reserve:
    """What :func:`unit_memory` reserves below the cap, by part, each at the widest
    boundary (units, groups) since the cuts are not known yet."""

    widest: float
    """The widest boundary tensor (bytes of one microbatch's)."""
    kept: int
    """Boundary tensors kept for backward: one per microbatch in flight (two with
    checkpointing: the stage's input and output)."""
    messages: int
    """Pipeline messages a rank holds at its peak: sends until the peer takes them (at
    most the microbatches in flight), one posted receive per incoming stream
    (:func:`~mpar.partition._prediction.message_counts`)."""
    bucket: float
    """A gradient bucket under data parallelism."""
    working: float
    """The ZeRO-2/3 working set by unit or group."""
    recompute: float = 0.0
    """Per-block checkpointing: the largest block's activations while it is recomputed."""

    @property
    def total(self) -> float:
        parts = self.widest * (self.kept + self.messages) + self.bucket + self.working
        return parts + self.recompute

    def describe(self) -> str:
        w = _fmt(self.widest)
        parts = [
            (f"boundary tensors kept for backward ({self.kept} x {w})", self.widest * self.kept),
            (
                f"pipeline messages ({self.messages} x {w}: sends held until the peer takes "
                "them, at most the microbatches in flight, and one posted receive per "
                "incoming stream)",
                self.widest * self.messages,
            ),
            ("a gradient bucket", self.bucket),
            ("the ZeRO-2/3 working set", self.working),
            ("the largest block recomputed (per-block checkpointing)", self.recompute),
        ]
        return "; ".join(f"{what} {_fmt(b)}" for what, b in parts if b) or "nothing"


def reserve_parts(
    units: Sequence[UnitProfile],
    layout: MemoryLayout,
    in_flight: int,
    transfers: Sequence[MessageCounts] = (),
) -> Reserve:
    """The :class:`Reserve` of a layout with ``in_flight`` microbatches in flight."""
    return _reserve(units, layout, in_flight, transfers, working_set_for_solver(units, layout)[1])


def _reserve(
    units: Sequence[UnitProfile],
    layout: MemoryLayout,
    in_flight: int,
    transfers: Sequence[MessageCounts],
    working: float,
) -> Reserve:
    widest = max((boundary_bytes(u, layout) for u in units[:-1]), default=0.0)
    messages = max(
        (t.sends_forward + t.sends_backward + t.receives_forward + t.receives_backward
         for t in transfers),
        default=4,
    )  # fmt: skip
    kept = in_flight * (2 if layout.activation_checkpointing else 1)
    bucket = layout.bucket_bytes if layout.data_parallel_degree > 1 else 0.0
    recompute = recompute_peak_bytes(units, layout)  # the largest block, wherever it lands
    return Reserve(widest, kept, messages, bucket, working, recompute)


def _cap_note(device: float, process: float, v: int, reserve: Reserve) -> str:
    """How the per-stage cap came from the device's memory (for a no-fit message)."""
    per = f" / {v} virtual stages" if v > 1 else ""
    return (
        f"The cap per stage is the device memory {_fmt(device)}, less the process "
        f"{_fmt(process)}{per}, less a reserve of {_fmt(reserve.total)} for what depends "
        f"on where the cuts fall: {reserve.describe()}"
    )


def process_bytes(
    p: int, cost: CostModel, layout: MemoryLayout | None = None, moe_layers: int = 0
) -> float:
    """Memory a rank's process holds besides tensors (``CostModel.process_bytes``, plus
    ``pipeline_process_bytes`` and ``moe_pipeline_process_bytes`` per MoE layer of the
    model when it is split into a pipeline, and ``mixed_process_bytes`` under bf16/fp16)."""
    mixed = cost.mixed_process_bytes if layout is not None and layout.mixed else 0.0
    pipeline = cost.pipeline_process_bytes + moe_layers * cost.moe_pipeline_process_bytes
    return cost.process_bytes + (pipeline if p > 1 else 0.0) + mixed


def moe_layers(inputs: PlanInputs) -> int:
    """The model's mixture-of-experts layers, where the plan knows its experts."""
    return 0 if inputs.ep_splits is None else len(inputs.ep_splits.experts)


def host_memory(
    stages: Sequence[StagePlan], units: Sequence[UnitProfile], layout: MemoryLayout, p: int
) -> list[int]:
    """Per rank: host bytes of its stages' offloaded state (``unit_host_bytes``)."""
    by_name = {u.name: u for u in units}
    return [
        int(
            sum(unit_host_bytes(by_name[n], layout) for s in stages if s.rank == r for n in s.units)
        )
        for r in range(p)
    ]


def optimizer_step(
    stages: Sequence[StagePlan], units: Sequence[UnitProfile], layout: MemoryLayout, p: int
) -> list[int]:
    """Per rank: what the optimizer update adds (``optimizer_step_bytes``): its stages'
    gradient copies and the largest stage's temporaries. On a CUDA/XLA device with
    offload the update runs on the host and adds nothing to the device."""
    if layout.offloads_optimizer and not layout.host_is_device:
        return [0] * p
    by_name = {u.name: u for u in units}
    out = []
    for r in range(p):
        parts = [
            optimizer_step_bytes([by_name[n] for n in s.units], layout)
            for s in stages
            if s.rank == r
        ]
        out.append(int(sum(c for c, _ in parts) + max((t for _, t in parts), default=0.0)))
    return out


def _per_rank_step_bytes(
    stages: Sequence[StagePlan],
    units: Sequence[UnitProfile],
    inputs: PlanInputs,
    scale: float,
    per_unit: Callable[[UnitProfile], float],
) -> list[int]:
    """Per rank: ``per_unit(unit)`` summed over the rank's units, times ``scale`` (of
    one microbatch's profile) for every microbatch of the step."""
    by_name = {u.name: u for u in units}
    step = scale * inputs.schedule.microbatches
    return [
        int(step * sum(per_unit(by_name[n]) for s in stages if s.rank == r for n in s.units))
        for r in range(inputs.grid.pp)
    ]


def tp_step_bytes(
    stages: Sequence[StagePlan],
    units: Sequence[UnitProfile],
    layout: MemoryLayout,
    inputs: PlanInputs,
) -> list[int]:
    """Per rank: bytes one TP rank sends in TP collectives per step (every microbatch)."""
    scale = layout.microbatch_scale * layout.dtype_factor
    return _per_rank_step_bytes(stages, units, inputs, scale, lambda u: u.tp_comm_bytes)


def ep_step_bytes(
    stages: Sequence[StagePlan],
    units: Sequence[UnitProfile],
    layout: MemoryLayout,
    inputs: PlanInputs,
) -> list[int]:
    """Per rank: bytes one rank sends in expert all-to-alls per step (every microbatch)."""
    scale = layout.microbatch_scale * layout.dtype_factor
    return _per_rank_step_bytes(stages, units, inputs, scale, lambda u: u.ep_comm_bytes)


def cp_step_bytes(
    stages: Sequence[StagePlan],
    units: Sequence[UnitProfile],
    layout: MemoryLayout,
    inputs: PlanInputs,
) -> list[int]:
    """Per rank: bytes one CP rank sends for attention per step (every microbatch)."""
    f = layout.dtype_factor
    return _per_rank_step_bytes(
        stages,
        units,
        inputs,
        layout.microbatch_scale,
        lambda u: u.cp_comm_bytes * f + u.cp_comm_fp32_bytes,
    )


def rank_overheads(
    stages: Sequence[StagePlan],
    inputs: PlanInputs,
    layout: MemoryLayout,
    cost: CostModel,
    units: Sequence[UnitProfile],
) -> list[float]:
    """Per rank: data-parallel sync and offload seconds per step."""
    by_name = {u.name: u for u in units}
    s = inputs.schedule
    return [
        step_overhead_s(
            [[by_name[n] for n in stage.units] for stage in stages if stage.rank == r],
            layout,
            cost,
            pipeline=s.pipeline,
            virtual_stages=s.virtual_stages,
            microbatches=s.microbatches,
        )
        for r in range(inputs.grid.pp)
    ]


def _placement(pipeline: str, num_stages: int, p: int) -> Callable[[int], int]:
    """Stage -> rank as the schedule places stages (looped, or zbv's V)."""
    from mpar.schedule import placement_of, stage_rank

    placement = placement_of(pipeline)
    return lambda s: stage_rank(s, num_stages, p, placement)


def _stage_plans(
    units: Sequence[UnitProfile],
    starts: Sequence[int],
    home: Callable[[int], int],
    in_flight: Sequence[int],
    layout: MemoryLayout,
    comm: Sequence[float] | None,
    compute: Sequence[float],
    transfers: Sequence[MessageCounts] = (),
    tp_comm: Sequence[float] = (),
    cp_comm: Sequence[float] = (),
) -> list[StagePlan]:
    total = math.fsum(compute) or 1.0
    plans = []
    ends = [*starts[1:], len(units)]
    for s, (a, b) in enumerate(zip(starts, ends)):
        group = units[a:b]
        rank = home(s)
        flight = in_flight[rank]
        state = int(sum(unit_state_bytes(u, layout) for u in group))
        state += _tied_replicas(group, {u.name for u in group})
        # stage 0's layers never defer (nothing waits for its I): its W is one whole
        # backward, holding what the forward saved
        held = layout if s > 0 else dataclasses.replace(layout, weight_work=False)
        act = int(sum(unit_held_bytes(u, held, flight) for u in group))
        act += int(recompute_peak_bytes(group, layout))
        moved = transfers[s] if s < len(transfers) else None
        extra = int(stage_extra_bytes(units, a, b, flight, layout, moved))
        seconds = math.fsum(compute[a:b])
        plans.append(
            StagePlan(
                s,
                rank,
                s // len(in_flight),
                [u.name for u in group],
                seconds,
                seconds / total,
                sum(u.param_count for u in group),
                state,
                act,
                flight,
                state + act + extra,
                "",
                comm[b - 1] if comm is not None and b < len(units) else 0.0,
                [n for u in group for n in u.outer_params],
                extra,
                math.fsum(tp_comm[a:b]),
                math.fsum(cp_comm[a:b]),
            )
        )
    return plans


def _bind(laid: Laid, cap: float | None) -> str:
    """Label what binds each stage and the plan; returns the plan-level label."""
    compute, memory, comm, starts, weight = (
        laid.compute, laid.memory, laid.comm, laid.starts, laid.weight
    )  # fmt: skip
    costs = stage_costs(compute, starts, memory=memory, memory_weight=weight, comm=comm)
    top = max(costs)
    plan_binding = "compute"
    if cap is not None:
        free = solve(compute, len(starts), memory=memory, memory_weight=weight, comm=comm)
        free_top = max(stage_costs(compute, free, memory=memory, memory_weight=weight, comm=comm))
        if top > free_top * (1 + 1e-9):
            plan_binding = "memory cap"
    for stage, cost in zip(laid.stages, costs):
        if cap is not None and stage.memory_bytes > cap:
            stage.binding = "over memory cap"
        elif cost >= top * (1 - 1e-9):
            stage.binding = "single unit" if len(stage.units) == 1 else plan_binding
        elif cap is not None and stage.memory_bytes >= 0.9 * cap:
            stage.binding = "memory cap"
    bottleneck = next(s for s, c in zip(laid.stages, costs) if c >= top * (1 - 1e-9))
    if plan_binding == "compute" and len(bottleneck.units) == 1:
        plan_binding = "single unit"
    return plan_binding
