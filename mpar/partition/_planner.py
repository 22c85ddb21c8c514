"""``make_plan``: a partition and memory plan from a profile, before anything runs.

Stages are laid out looped, as in Megatron-LM: with ``p`` ranks and ``v``
virtual stages there are ``p * v`` stages and stage ``s`` runs on rank
``s % p`` as its chunk ``s // p``.

Memory per stage is its share of a rank's *peak* (``mpar.partition._memory_model``):
parameters, gradients and optimizer state of its units by ZeRO stage, precision
and offload (tied replicas included), saved activations per microbatch in
flight on its rank (from ``mpar.schedule``'s ``peak_in_flight``, spread evenly
over the rank's chunks; one microbatch's with activation checkpointing), and
``extra_bytes``: kept boundary tensors, pipeline message buffers (counted from
the schedule, ``_transfers``), the ZeRO-2/3 working set, a gradient bucket
and, on the last stage, the loss; each rank adds its process's memory besides
tensors (``CostModel.process_bytes``). ``device_memory`` caps a rank; the solver
caps each of its ``v`` stages at ``(device_memory - process) / v`` (less a
reserve for the cut-dependent extras) and the exact figures are reported.

Communication: a stage that is not the last sends its last unit's output on
in the forward pass and receives the gradient of the same size back, so it
costs ``comm = 2 * output_bytes / link_bandwidth`` seconds per microbatch
(``link_bandwidth`` in bytes per second, default 10 GB/s; None leaves
communication out). The solver adds it to the stage's compute (see
``solve(comm=...)``), so cuts land where activations are small when the times
allow.

Predicted step time and bubble come from simulating the schedule with the
profiled stage times (forward = 1/3, backward = 2/3 of the measured
forward+backward time, each plus half the stage's ``comm``). Without ``mpar.schedule`` the plan falls back to
``step = m * W + (p - 1) * T`` and ``bubble = (p - 1) / (v * m + p - 1)`` for
uniform chunks, where ``W`` is the busiest rank's time per microbatch and ``T``
the slowest stage's. ``step_time_s`` adds ``overhead_s``: the busiest rank's
data-parallel sync and offload time per step (``mpar.partition._cost``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mpar._size import parse_bytes
from mpar.errors import PartitionError
from mpar.partition._cost import CostModel, step_overhead_s
from mpar.partition._memory_model import (
    Layout,
    Transfers,
    boundary_bytes,
    effective_gather,
    loss_bytes,
    optimizer_step_bytes,
    stage_extra_bytes,
    unit_held_bytes,
    unit_host_bytes,
    unit_state_bytes,
    working_set_for_solver,
)
from mpar.partition._methods import parameter_boundaries, uniform_boundaries
from mpar.partition._solver import _fmt, memory_weight_for, solve, stage_costs
from mpar.partition._tp_share import TPSplits, tp_comm_s, tp_share
from mpar.schedule._csv import is_csv_path
from mpar.schedule._registry import PIPELINES

if TYPE_CHECKING:
    from mpar.profile import ModelProfile, UnitProfile

__all__ = [
    "Plan",
    "StagePlan",
    "lay_out",
    "lower_bound_s",
    "make_plan",
    "parse_bytes",
    "unit_memory",
]

_METHODS = ("profile", "uniform", "parameters")


@dataclass
class StagePlan:
    """One pipeline stage of a plan."""

    stage: int
    rank: int
    chunk: int
    """Which of the rank's virtual stages this is."""
    units: list[str]
    time_s: float
    """Profiled forward+backward time of one microbatch."""
    compute_share: float
    """Fraction of the model's total time."""
    param_count: int
    state_bytes: int
    """Parameters + gradients + optimizer state held by this stage."""
    activation_bytes: int
    """Saved activations of one microbatch times ``in_flight``."""
    in_flight: int
    memory_bytes: int
    binding: str
    """What limits this stage: "compute", "single unit", "memory cap", "over memory cap" or ""."""
    comm_s: float = 0.0
    """Seconds per microbatch to send the output on and receive its gradient (0 for the last)."""
    outer_params: list[str] = field(default_factory=list)
    """Parameters outside every unit held by this stage (a root-level position table, say)."""
    extra_bytes: int = 0
    """Kept boundary tensors, send/receive buffers, a gradient bucket, the loss (last stage)."""
    tp_comm_s: float = 0.0
    """Seconds per microbatch of the stage's tensor-parallel collectives (in ``time_s``)."""


@dataclass
class Plan:
    """A partition with its predicted cost; ``str(plan)`` is a table, ``to_dict()`` is JSON-able."""

    stages: list[StagePlan]
    boundaries: list[int]
    num_ranks: int
    virtual_stages: int
    microbatches: int
    pipeline: str
    method: str
    memory_weight: float
    device_memory: int | None
    step_time_s: float
    bubble: float
    binding: str
    """What limits the plan as a whole: "compute", "single unit" or "memory cap"."""
    rank_memory_bytes: list[int] = field(default_factory=list)
    simulated: bool = False
    """True when step time and bubble come from ``mpar.schedule.simulate``."""
    link_bandwidth: float | None = None
    """Bytes per second between neighbouring stages; None when communication is not modelled."""
    overhead_s: float = 0.0
    """Data-parallel sync and offload seconds per step (in ``step_time_s``)."""
    process_bytes: int = 0
    """Memory each rank's process holds besides tensors (in ``rank_memory_bytes``)."""
    optimizer_step_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank: what the optimizer update adds to the rank's state after the
    backward (mixed precision's fp32 gradient copies, Adam's temporaries). A rank's peak
    is ``process + state + max(activations + extras, this)``."""
    host_memory_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank: host bytes of offloaded state (optimizer state, master copy, the
    host gradient, parameter shards; ``unit_host_bytes``). On a CPU device the same memory
    as the device's, so already inside ``rank_memory_bytes``; elsewhere beside it."""
    microbatch_size: int | None = None
    """Samples per microbatch the figures assume (None: the profiled microbatch's)."""
    layout: dict[str, Any] = field(default_factory=dict)
    """The ``Layout`` knobs (dp, ZeRO, precision, checkpointing, offload, microbatch scale,
    the ZeRO 2/3 gather granularity the runtime will use)."""
    tensor_parallel_degree: int = 1
    """Ranks that split each layer; every figure above is one TP rank's (``mpar.partition._tp_share``)."""
    tp_bandwidth: float | None = None
    """Bytes per second per rank in TP collectives; None when they are not modelled."""
    tp_comm_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank: bytes one TP rank sends in TP collectives per step."""
    tp_source: str = ""
    """Where the TP plan came from (empty at tp = 1)."""
    split_backward_gain: float | None = None
    """Under a split-backward schedule (zero_bubble, zbv): 1F1B's predicted step over this
    schedule's on the same stages; below 1 the split costs more than the bubble it fills.
    None for other schedules."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return _render(self)


# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _schedule(pipeline: str, p: int, v: int, m: int, active_microbatches: int | None) -> Any:
    """The schedule of these config keys, as the runtime builds it (unit costs)."""
    from mpar import schedule as sched

    return sched.build_schedule(
        pipeline, p, m, virtual_stages=v, active_microbatches=active_microbatches
    )


@functools.lru_cache(maxsize=4096)
def _in_flight(
    p: int, v: int, m: int, pipeline: str, active_microbatches: int | None = None
) -> tuple[list[int], Any]:
    """Per rank: microbatches in flight per chunk; and the schedule module or None.

    The schedule is the one the runtime runs: ``active_microbatches`` caps it as the
    config key does. ``zero_bubble`` with ``active_microbatches`` above ZB-H1's peak (an
    allowance, ``mpar.schedule.zero_bubble_allowance``) may be placed from measured times
    to hold that many on any rank (``runtime._placement``): counted so."""
    sched: Any
    try:
        from mpar import schedule as sched
    except ImportError:  # pragma: no cover - the schedule package is part of mpar
        sched = None
    if sched is not None:
        built = _schedule(pipeline, p, v, m, active_microbatches)
        peaks = sched.peak_in_flight(built)
        if pipeline == "zero_bubble":
            allowance = sched.zero_bubble_allowance(p, m, v, active_microbatches)
            peaks = peaks if allowance is None else [allowance] * p
        return [max(1, math.ceil(peak / v)) for peak in peaks], sched
    if pipeline == "simple":
        return [m] * p, None
    if v == 1:
        return [min(m, p - r) for r in range(p)], None
    warm = [(p - r - 1) * 2 + (v - 1) * p + 1 for r in range(p)]
    return [min(m, math.ceil(w / v)) for w in warm], None


@functools.lru_cache(maxsize=4096)
def _transfers(
    p: int, v: int, m: int, pipeline: str, active_microbatches: int | None = None
) -> tuple[Transfers, ...]:
    """Per stage: the pipeline messages its rank holds at the rank's peak.

    Walks each rank's action list as the runtime executes it: every F of a stage
    whose next stage is on another rank sends an activation message, every B (or I)
    of a stage whose previous stage is on another rank sends a gradient message, and
    the runtime keeps each until the step ends. The count is taken at the last action
    where the rank's microbatches in flight are at their peak (later actions only
    free activations faster than they add messages). Each remote incoming stream has
    one receive posted.
    """
    from mpar.schedule import Kind

    schedule = _schedule(pipeline, p, v, m, active_microbatches)
    n = schedule.num_stages
    rank_of = [schedule.stage_to_rank(s) for s in range(n)]
    remote_next = [s + 1 < n and rank_of[s + 1] != rank_of[s] for s in range(n)]
    remote_prev = [s > 0 and rank_of[s - 1] != rank_of[s] for s in range(n)]
    at_peak: dict[int, tuple[int, int]] = {}
    for rank in range(p):
        fwd, bwd = [0] * n, [0] * n
        current = peak = 0
        for action in schedule.actions.get(rank, []):
            s = action.stage
            if action.kind == Kind.F:
                current += 1
                fwd[s] += remote_next[s]
            elif action.kind in (Kind.B, Kind.I):
                bwd[s] += remote_prev[s]
            if action.kind in (Kind.B, Kind.W):
                current -= 1
            if current >= peak:
                peak = current
                at_peak.update({t: (fwd[t], bwd[t]) for t in range(n) if rank_of[t] == rank})
    return tuple(
        Transfers(*at_peak.get(s, (0, 0)), int(remote_prev[s]), int(remote_next[s]))
        for s in range(n)
    )


def _phase_times(
    stages: Sequence[StagePlan], checkpointing: bool, cost: CostModel
) -> tuple[list[float], list[float]]:
    """Per stage: forward and backward seconds of one microbatch, comm included."""
    fwd = [s.time_s / 3 + s.comm_s / 2 for s in stages]
    extra = cost.recompute_fraction if checkpointing else 0.0
    bwd = [(2 / 3 + extra) * s.time_s + s.comm_s / 2 for s in stages]
    return fwd, bwd


@functools.lru_cache(maxsize=8192)
def _simulate(
    pipeline: str,
    p: int,
    v: int,
    m: int,
    fwd: tuple[float, ...],
    bwd: tuple[float, ...],
    split: tuple[float, float, float] = (0.5, 0.5, 0.0),
    active_microbatches: int | None = None,
) -> tuple[float, float]:
    """(makespan, bubble) of ``pipeline`` (capped by ``active_microbatches`` as the
    runtime caps it); ``split`` = (I fraction, W fraction, seconds per split action)
    prices I and W where the schedule splits the backward (the first stage has no I: its
    W is its whole backward, as the runtime runs it)."""
    sched: Any
    from mpar import schedule as sched

    i_share, w_share, action = split
    ib = [0.0 if s == 0 else i_share * b for s, b in enumerate(bwd)]
    wb = [b if s == 0 else w_share * b + action for s, b in enumerate(bwd)]
    costs = sched.StageCosts(fwd, bwd, input_backward=ib, weight_backward=wb)
    result = sched.simulate(_schedule(pipeline, p, v, m, active_microbatches), costs)
    return float(result.makespan), float(result.bubble_fraction)


@functools.lru_cache(maxsize=256)
def splits_backward(pipeline: str, p: int, v: int, m: int) -> bool:
    """Whether ``pipeline`` runs split backwards (I and W actions): zero_bubble, zbv, or a
    schedule CSV that has them."""
    from mpar import schedule as sched

    schedule = _schedule(pipeline, p, v, m, None)
    kinds = {a.kind for actions in schedule.actions.values() for a in actions}
    return bool(kinds & {sched.Kind.I, sched.Kind.W})


def split_backward_gain(
    stages: Sequence[StagePlan],
    p: int,
    v: int,
    m: int,
    pipeline: str,
    checkpointing: bool,
    cost: CostModel,
    active_microbatches: int | None = None,
) -> float | None:
    """Predicted step of 1F1B (``interleaved``) over that of ``pipeline`` on the same
    stages and cap, when ``pipeline`` splits the backward; None otherwise (or when 1F1B
    cannot run this shape). Below 1, the split backward costs more than the bubble it
    fills."""
    from mpar.errors import ScheduleError

    k = active_microbatches
    try:
        if not splits_backward(pipeline, p, v, m):
            return None
        fwd, bwd = _phase_times(stages, checkpointing, cost)
        split = _split_costs(cost)
        mine = _simulate(pipeline, p, v, m, tuple(fwd), tuple(bwd), split, k)[0]
        plain = _simulate("interleaved", p, v, m, tuple(fwd), tuple(bwd), active_microbatches=k)[0]
    except ScheduleError:
        return None
    return plain / mine if mine > 0 else None


def _split_costs(cost: CostModel) -> tuple[float, float, float]:
    return (cost.input_backward_fraction, cost.weight_backward_fraction, cost.split_action_s)


def _predict(
    stages: Sequence[StagePlan],
    p: int,
    v: int,
    m: int,
    pipeline: str,
    sched: Any,
    checkpointing: bool = False,
    cost: CostModel | None = None,
    active_microbatches: int | None = None,
) -> tuple[float, float, bool]:
    """(pipeline makespan, bubble fraction, simulated?) from per-stage times."""
    fwd, bwd = _phase_times(stages, checkpointing, cost or CostModel())
    if sched is not None:
        split = _split_costs(cost or CostModel())
        simulated = _simulate(pipeline, p, v, m, tuple(fwd), tuple(bwd), split, active_microbatches)
        return (*simulated, True)
    times = [f + b for f, b in zip(fwd, bwd)]
    work = max(sum(times[r::p]) for r in range(p))
    step = m * work + (p - 1) * max(times)
    return step, (p - 1) / (v * m + p - 1), False


def lower_bound_s(
    stages: Sequence[StagePlan], p: int, m: int, checkpointing: bool, cost: CostModel
) -> float:
    """A lower bound of the makespan: the busiest rank's work for ``m`` microbatches."""
    fwd, bwd = _phase_times(stages, checkpointing, cost)
    return m * max(sum(f + b for f, b in zip(fwd[r::p], bwd[r::p])) for r in range(p))


def _tied_replicas(units: Sequence[UnitProfile], names: set[str]) -> int:
    """State bytes of tied parameters a stage holds whose owner is on another stage."""
    extra: dict[str, int] = {}
    for unit in units:
        for owner, nbytes in unit.tied_state_bytes.items():
            if owner not in names:
                extra[owner] = max(extra.get(owner, 0), nbytes)
    return sum(extra.values())


def _comm(
    units: Sequence[UnitProfile], layout: Layout, bandwidth: float | None
) -> list[float] | None:
    """Per unit: seconds to send its output on and its gradient back, per microbatch."""
    if bandwidth is None:
        return None
    return [2 * boundary_bytes(u, layout) / bandwidth for u in units]


def _bandwidth(value: float | str | None, name: str = "link_bandwidth") -> float | None:
    if value is None:
        return None
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    bandwidth = float(parse_bytes(text))
    if not bandwidth > 0:
        raise PartitionError(
            f"{name} must be a positive number of bytes per second (e.g. 10GB), "
            f"got {value!r}; pass None to leave communication out"
        )
    return bandwidth


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


def _check(
    profile: ModelProfile, num_ranks: int, v: int, m: int, pipeline: str, method: str
) -> None:
    for name, value in (("num_ranks", num_ranks), ("virtual_stages", v), ("microbatches", m)):
        if not isinstance(value, int) or value < 1:
            raise PartitionError(f"{name} must be a positive integer, got {value!r}")
    if pipeline not in PIPELINES and not is_csv_path(pipeline):
        raise PartitionError(
            f"pipeline must be one of {', '.join(PIPELINES)} or a schedule CSV; got {pipeline!r}"
        )
    if method not in _METHODS:
        raise PartitionError(f"method must be one of {', '.join(_METHODS)}; got {method!r}")
    if len(profile.units) < num_ranks * v:
        raise PartitionError(
            f"{num_ranks} ranks x {v} virtual stages = {num_ranks * v} stages but the model "
            f"has only {len(profile.units)} units; lower pipeline_parallel_degree or "
            "virtual_stages"
        )


def unit_memory(
    units: Sequence[UnitProfile],
    layout: Layout,
    in_flight: int,
    transfers: Sequence[Transfers] = (),
) -> tuple[list[float], float]:
    """Per-unit memory for the solver, and the bytes to reserve below the cap.

    Additive parts go to the units (states, saved activations per microbatch in
    flight or one microbatch's recomputed ones, the loss on the last unit, the ZeRO
    working set when it is gathered by chunk); what depends on where the cuts fall
    (kept boundary tensors, message buffers, the ZeRO working set by unit or group)
    is bounded by the largest boundary and units and reserved from the cap.
    """
    working, reserve = working_set_for_solver(units, layout)
    memory = [
        unit_state_bytes(u, layout) + unit_held_bytes(u, layout, in_flight) + w
        for u, w in zip(units, working)
    ]
    memory[-1] += loss_bytes(units[-1], layout, in_flight)
    widest = max((boundary_bytes(u, layout) for u in units[:-1]), default=0.0)
    messages = max(
        (t.sends_forward + t.sends_backward + t.receives_forward + t.receives_backward
         for t in transfers),
        default=4,
    )  # fmt: skip
    copies = in_flight * (2 if layout.activation_checkpointing else 1) + messages
    bucket = layout.bucket_bytes if layout.data_parallel_degree > 1 else 0
    return memory, widest * copies + bucket + reserve


def process_bytes(p: int, cost: CostModel, layout: Layout | None = None) -> float:
    """Memory a rank's process holds besides tensors (``CostModel.process_bytes``, plus
    ``pipeline_process_bytes`` when the model is split into a pipeline and
    ``mixed_process_bytes`` under bf16/fp16)."""
    mixed = cost.mixed_process_bytes if layout is not None and layout.mixed else 0.0
    return cost.process_bytes + (cost.pipeline_process_bytes if p > 1 else 0.0) + mixed


def host_memory(
    stages: Sequence[StagePlan], units: Sequence[UnitProfile], layout: Layout, p: int
) -> list[int]:
    """Per rank: host bytes of its stages' offloaded state (``unit_host_bytes``)."""
    by_name = {u.name: u for u in units}
    return [
        int(
            sum(unit_host_bytes(by_name[n], layout) for s in stages if s.rank == r for n in s.units)
        )
        for r in range(p)
    ]


@dataclass
class _Laid:
    """A partition with per-stage figures, before the schedule is simulated."""

    starts: list[int]
    stages: list[StagePlan]
    in_flight: list[int]
    sched: Any
    memory: list[float]
    comm: list[float] | None
    compute: list[float]
    rank_memory: list[int]
    host_memory: list[int] = field(default_factory=list)
    optimizer_step: list[int] = field(default_factory=list)


def lay_out(
    profile: ModelProfile,
    p: int,
    v: int,
    m: int,
    pipeline: str,
    *,
    layout: Layout,
    cost: CostModel,
    weight: float = 0.0,
    cap_rank: int | None = None,
    method: str = "profile",
    active_microbatches: int | None = None,
) -> _Laid:
    """Partition for one layout and compute every stage's memory and time (no simulation)."""
    in_flight, sched = _in_flight(p, v, m, pipeline, active_microbatches)
    transfers = _transfers(p, v, m, pipeline, active_microbatches) if sched is not None else ()
    units = profile.units
    memory, reserve = unit_memory(units, layout, max(in_flight), transfers)
    process = process_bytes(p, cost, layout)
    cap = None if cap_rank is None else max((cap_rank - process) / v - reserve, 0.0)
    comm = _comm(units, layout, cost.link_bandwidth)
    speed = cost.mixed_speedup if layout.mixed else 1.0
    k = layout.microbatch_scale
    tp = [tp_comm_s(u, k * layout.dtype_factor, cost.tp_bandwidth) for u in units]
    compute = [
        (u.fixed_time_s + (u.time_s - u.fixed_time_s) * k) / speed + t for u, t in zip(units, tp)
    ]
    starts = _boundaries(profile, method, p * v, memory, weight, cap, comm, compute)
    home = _placement(pipeline, p * v, p)
    stages = _stage_plans(units, starts, home, in_flight, layout, comm, compute, transfers, tp)
    step = optimizer_step(stages, units, layout, p)
    rank_memory = [
        int(process)
        + sum(s.state_bytes for s in stages if s.rank == r)
        + max(sum(s.memory_bytes - s.state_bytes for s in stages if s.rank == r), step[r])
        for r in range(p)
    ]
    host = host_memory(stages, units, layout, p)
    return _Laid(starts, stages, in_flight, sched, memory, comm, compute, rank_memory, host, step)


def optimizer_step(
    stages: Sequence[StagePlan], units: Sequence[UnitProfile], layout: Layout, p: int
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


def make_plan(
    profile: ModelProfile,
    *,
    num_ranks: int,
    virtual_stages: int = 1,
    microbatches: int = 1,
    pipeline: str = "interleaved",
    memory_weight: float | None = None,
    optimize: str = "speed",
    device_memory: int | str | None = None,
    method: str = "profile",
    data_parallel_degree: int = 1,
    zero_stage: int = 0,
    link_bandwidth: float | str | None = "10GB",
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    microbatch_scale: float = 1.0,
    cost: CostModel | None = None,
    gather: str | int = "unit",
    device: str = "cuda",
    microbatch_size: int | None = None,
    tensor_parallel_degree: int = 1,
    tp_splits: TPSplits | None = None,
    active_microbatches: int | None = None,
    split_backward: bool = True,
) -> Plan:
    """Partition a profiled model over ``num_ranks`` pipeline ranks and predict its cost.

    Args:
        profile: from ``mpar.profile.profile_model`` (one microbatch).
        num_ranks: pipeline-parallel degree ``p``.
        virtual_stages: chunks per rank ``v`` (``p * v`` stages).
        microbatches: microbatches per step ``m``.
        pipeline: a name in ``mpar.schedule.PIPELINES`` or a schedule CSV path.
        active_microbatches: the config key: it caps the schedule whose microbatches in
            flight, messages and step time are counted, as it caps the one that runs;
            ``zero_bubble``'s allowance (a value above ZB-H1's peak, which a placement from
            measured times may use on any rank) counts that many on every rank.
        split_backward: the config key; with a schedule that splits the backward
            (``zero_bubble``, ``zbv``, a CSV with W actions), a microbatch whose W waits
            is counted with what W keeps (``Layout.weight_work``).
        memory_weight: weight of memory against compute; default from ``optimize``
            ("speed" → 0.2, "memory" → 0.8).
        device_memory: bytes (or "16GiB") available per rank; enforced by "profile".
        method: "profile" (optimal on profiled time and memory), "uniform" (equal
            units) or "parameters" (equal parameter counts).
        data_parallel_degree, zero_stage: shard optimizer state (>=1), gradients
            (>=2) and parameters (3) over the data-parallel group in the memory figures.
        link_bandwidth: bytes per second between neighbouring stages ("10GB", "100MB/s"
            or a number); each cut costs ``2 * output_bytes / link_bandwidth`` per
            microbatch. None leaves communication out.
        precision: "fp32", "bf16" or "fp16" (mixed precision: compute-dtype parameters,
            gradients and activations, fp32 master weights with the optimizer state).
        activation_checkpointing: stages keep only their inputs and recompute.
        offload_optimizer, offload_params: optimizer state / parameter shards on the host.
        microbatch_scale: samples per microbatch over the profiled microbatch's samples.
        cost: bandwidths and speed factors (``CostModel``); its ``link_bandwidth`` is
            replaced by the ``link_bandwidth`` argument.
        gather: ZeRO 2/3 granularity inside a stage (``zero.gather``: "unit", "chunk" or
            an int); schedules with a split backward gather by chunk whatever it says
            (``effective_gather``).
        device: the kind the ranks compute on, "cuda", "xla" or "cpu": on "cpu" offloaded
            state counts in the rank's memory (``Layout.device``).
        microbatch_size: samples per microbatch, only reported (``microbatch_scale``
            scales the figures).
        tensor_parallel_degree, tp_splits: ranks splitting each layer, and what the TP
            plan splits (``mpar.partition._tp_share``); the figures become one TP rank's and
            each unit's time gains its TP collectives over ``cost.tp_bandwidth``.
    """
    p, v, m, tp = num_ranks, virtual_stages, microbatches, tensor_parallel_degree
    if tp != 1:
        if tp_splits is None:
            raise PartitionError(
                f"tensor_parallel_degree {tp} needs tp_splits (what the model's TP plan "
                "splits, from mpar.partition._tp_measure.measure_splits)"
            )
        profile = tp_share(profile, tp_splits, tp)
    _check(profile, p, v, m, pipeline, method)
    weight = memory_weight_for(optimize, memory_weight)
    cap_rank = None if device_memory is None else parse_bytes(device_memory)
    cost = dataclasses.replace(cost or CostModel(), link_bandwidth=_bandwidth(link_bandwidth))
    layout = Layout(
        data_parallel_degree,
        zero_stage,
        precision,
        activation_checkpointing,
        offload_optimizer,
        offload_params,
        microbatch_scale,
        gather=effective_gather(pipeline, gather),
        device=device,
        weight_work=split_backward and splits_backward(pipeline, p, v, m),
    )
    laid = lay_out(
        profile,
        p,
        v,
        m,
        pipeline,
        layout=layout,
        cost=cost,
        weight=weight,
        cap_rank=cap_rank,
        method=method,
        active_microbatches=active_microbatches,
    )
    makespan, bubble, simulated = _predict(
        laid.stages,
        p,
        v,
        m,
        pipeline,
        laid.sched,
        activation_checkpointing,
        cost,
        active_microbatches=active_microbatches,
    )
    overhead = max(
        rank_overheads(laid.stages, p, v, pipeline, layout, cost, profile.units, microbatches=m)
    )
    cap = None if cap_rank is None else cap_rank / v
    binding = _bind(laid, weight, cap)
    return Plan(
        laid.stages,
        laid.starts,
        p,
        v,
        m,
        pipeline,
        method,
        weight,
        cap_rank,
        makespan + overhead,
        bubble,
        binding,
        laid.rank_memory,
        simulated,
        cost.link_bandwidth,
        overhead_s=overhead,
        process_bytes=int(process_bytes(p, cost, layout)),
        host_memory_bytes=laid.host_memory,
        optimizer_step_bytes=laid.optimizer_step,
        microbatch_size=microbatch_size,
        layout=dataclasses.asdict(layout),
        tensor_parallel_degree=tp,
        tp_bandwidth=cost.tp_bandwidth if tp > 1 else None,
        tp_comm_bytes=tp_step_bytes(laid.stages, profile.units, layout, p, m),
        tp_source=tp_splits.source if tp > 1 and tp_splits is not None else "",
        split_backward_gain=split_backward_gain(
            laid.stages, p, v, m, pipeline, activation_checkpointing, cost, active_microbatches
        ),
    )


def tp_step_bytes(
    stages: Sequence[StagePlan], units: Sequence[UnitProfile], layout: Layout, p: int, m: int
) -> list[int]:
    """Per rank: bytes one TP rank sends in TP collectives per step (``m`` microbatches)."""
    by_name = {u.name: u for u in units}
    scale = layout.microbatch_scale * layout.dtype_factor * m
    return [
        int(scale * sum(by_name[n].tp_comm_bytes for s in stages if s.rank == r for n in s.units))
        for r in range(p)
    ]


def rank_overheads(
    stages: Sequence[StagePlan],
    p: int,
    v: int,
    pipeline: str,
    layout: Layout,
    cost: CostModel,
    units: Sequence[UnitProfile],
    *,
    microbatches: int = 1,
) -> list[float]:
    """Per rank: data-parallel sync and offload seconds per step."""
    by_name = {u.name: u for u in units}
    return [
        step_overhead_s(
            [[by_name[n] for n in s.units] for s in stages if s.rank == r],
            layout,
            cost,
            pipeline=pipeline,
            virtual_stages=v,
            microbatches=microbatches,
        )
        for r in range(p)
    ]


def _placement(pipeline: str, num_stages: int, p: int) -> Any:
    """Stage -> rank as the schedule places stages (looped, or zbv's V)."""
    from mpar.schedule import placement_of, stage_rank

    placement = placement_of(pipeline)
    return lambda s: stage_rank(s, num_stages, p, placement)


def _stage_plans(
    units: Sequence[UnitProfile],
    starts: Sequence[int],
    home: Any,
    in_flight: Sequence[int],
    layout: Layout,
    comm: Sequence[float] | None,
    compute: Sequence[float],
    transfers: Sequence[Transfers] = (),
    tp_comm: Sequence[float] = (),
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
            )
        )
    return plans


def _bind(laid: _Laid, weight: float, cap: float | None) -> str:
    """Label what binds each stage and the plan; returns the plan-level label."""
    compute, memory, comm, starts = laid.compute, laid.memory, laid.comm, laid.starts
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


def _units_label(names: Sequence[str]) -> str:
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)})"


def _split_note(plan: Plan) -> list[str]:
    """Whether the split backward pays for itself here (zero_bubble, zbv)."""
    gain = plan.split_backward_gain
    if gain is None:
        return []
    head = (
        f"split backward: {plan.pipeline} predicted {gain:.2f}x the speed of 1F1B "
        f"('interleaved') on these stages at {plan.microbatches} microbatches"
    )
    if gain >= 1.02:
        return [head]
    return [
        head + ": the split backward does not pay here (its own cost, and the first "
        "stage's backward that cannot split, outweigh the bubble it fills); use pipeline "
        "'interleaved'. The split pays where the bubble is large: few microbatches per "
        "pipeline stage (the bubble is about (p - 1) / (m + p - 1) of 1F1B's step)"
    ]


def _render(plan: Plan) -> str:
    tp = plan.tensor_parallel_degree
    head = (
        f"pipeline plan: {plan.num_ranks} ranks x {plan.virtual_stages} virtual stages, "
        f"{f'tensor parallel x{tp}, ' if tp > 1 else ''}"
        f"{plan.microbatches} microbatches, {plan.pipeline}, method={plan.method}, "
        f"memory_weight={plan.memory_weight:g}"
    )
    rows = [
        (
            "stage",
            "rank",
            "units",
            "time ms",
            "comm ms",
            "share",
            "params",
            "state",
            "activ.",
            "memory",
            "binds",
        )
    ]
    for s in plan.stages:
        rows.append(
            (
                str(s.stage),
                str(s.rank),
                _units_label(s.units),
                f"{s.time_s * 1e3:.4g}",
                f"{s.comm_s * 1e3:.4g}",
                f"{s.compute_share:.1%}",
                f"{s.param_count:,}",
                _fmt(s.state_bytes),
                f"{_fmt(s.activation_bytes // max(s.in_flight, 1))} x{s.in_flight}",
                _fmt(s.memory_bytes),
                s.binding,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    cap = "none" if plan.device_memory is None else _fmt(plan.device_memory)
    peak = max(plan.rank_memory_bytes) if plan.rank_memory_bytes else 0
    source = "simulated" if plan.simulated else "formula"
    link = "not modelled" if plan.link_bandwidth is None else f"{_fmt(plan.link_bandwidth)}/s"
    lines += [
        f"stage {s.stage} also holds {', '.join(s.outer_params)} (outside every unit)"
        for s in plan.stages
        if s.outer_params
    ]
    lines += _gather_note(plan.layout, plan.pipeline)
    lines += _tp_note(plan)
    lines += _host_note(plan)
    lines += _split_note(plan)
    lines += [
        "",
        f"predicted step time {plan.step_time_s * 1e3:.4g} ms, bubble {plan.bubble:.1%} ({source}); "
        f"{_microbatch_note(plan)}busiest rank memory {_fmt(peak)} on the "
        f"{plan.layout.get('device', 'cuda')} device (process {_fmt(plan.process_bytes)} included; "
        f"cap {cap}); bound by {plan.binding}; "
        f"links {link}",
    ]
    return "\n".join(lines)


def _gather_note(layout: dict[str, Any], pipeline: str) -> list[str]:
    """A line saying how ZeRO 2/3 gathers inside a stage, where it matters."""
    gather = layout.get("gather", "unit")
    if layout.get("zero_stage", 0) < 2 or gather == "unit":
        return []
    how = "the whole stage" if gather == "chunk" else f"groups of {gather} units"
    why = " (the schedule splits the backward)" if effective_gather(pipeline) == "chunk" else ""
    return [f"ZeRO-{layout['zero_stage']} gathers and reduces by {how}{why}"]


def _tp_note(plan: Plan) -> list[str]:
    """What tensor parallelism does to the figures, when it is on."""
    tp = plan.tensor_parallel_degree
    if tp == 1:
        return []
    link = "not modelled" if plan.tp_bandwidth is None else f"{_fmt(plan.tp_bandwidth)}/s"
    sent = _fmt(max(plan.tp_comm_bytes, default=0))
    return [
        f"tensor parallel x{tp} ({plan.tp_source}): figures are one TP rank's (split "
        f"parameters and their state 1/{tp}, activations in split regions 1/{tp}); TP "
        f"collectives send {sent} per rank per step over {link} (in each stage's time ms)"
    ]


def _microbatch_note(plan: Plan) -> str:
    scale = plan.layout.get("microbatch_scale", 1.0)
    if plan.microbatch_size is None:
        return f"microbatch: the profiled one x{scale:g}; "
    return f"microbatch: {plan.microbatch_size} samples (profile x{scale:g}); "


def _host_note(plan: Plan) -> list[str]:
    """Where offloaded state lives, when there is any."""
    host = max(plan.host_memory_bytes, default=0)
    if not host:
        return []
    if plan.layout.get("device") == "cpu":
        return [
            f"offloaded state {_fmt(host)} per rank stays in the same memory on a CPU device "
            "(counted in the rank's memory): offload saves nothing there"
        ]
    return [f"host memory per rank (offloaded state, pinned): {_fmt(host)}, beside the device's"]
