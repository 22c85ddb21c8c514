"""The plan as data (:class:`Plan`, :class:`StagePlan`) and as text (``str(plan)``).

``make_plan`` (``mpar.partition._planner``) fills these records; ``Plan.to_dict()`` is
what ``mpar plan --json`` prints and ``str(plan)`` the table ``mpar plan`` prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from mpar.partition._memory_model import MemoryLayout, effective_gather
from mpar.partition._solver import _fmt

__all__ = ["Plan", "PlanDict", "StagePlan", "render"]

PlanDict = dict[str, object]
"""A plan as JSON-able data (``Plan.to_dict``)."""


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
    """Seconds per microbatch of the stage's tensor-parallel collectives and expert
    all-to-alls (in ``time_s``)."""
    cp_comm_s: float = 0.0
    """Seconds per microbatch of the stage's context-parallel attention traffic (in
    ``time_s``)."""


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
    """Whether step time and bubble come from ``mpar.schedule.simulate`` (``make_plan``
    always simulates the schedule the runtime builds)."""
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
    layout: MemoryLayout = field(default_factory=MemoryLayout)
    """The memory model's knobs (dp, ZeRO, precision, checkpointing, offload, microbatch
    scale, the ZeRO 2/3 gather granularity the runtime will use)."""
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
    expert_parallel_degree: int = 1
    """Ranks that split each MoE layer's experts; the figures are one ep rank's
    (``mpar.partition._ep_share``)."""
    ep_bandwidth: float | None = None
    """Bytes per second per rank in the expert all-to-alls; None when not modelled."""
    ep_comm_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank: bytes one rank sends in expert all-to-alls per step."""
    context_parallel_degree: int = 1
    """Ranks that split each sequence; every figure above is one CP rank's
    (``mpar.partition._cp_share``)."""
    context_parallel_method: str = ""
    """"ring" or "all_to_all" (empty at cp = 1)."""
    cp_bandwidth: float | None = None
    """Bytes per second per rank of the attention traffic; None when not modelled."""
    cp_comm_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank: bytes one CP rank sends for attention per step."""

    def to_dict(self) -> PlanDict:
        return asdict(self)

    def __str__(self) -> str:
        return render(self)


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


_COLUMNS = ("stage", "rank", "units", "time ms", "comm ms", "share", "params", "state",
            "activations held", "memory", "binds")  # fmt: skip


def _row(s: StagePlan) -> tuple[str, ...]:
    return (
        str(s.stage),
        str(s.rank),
        _units_label(s.units),
        f"{s.time_s * 1e3:.4g}",
        f"{s.comm_s * 1e3:.4g}",
        f"{s.compute_share:.1%}",
        f"{s.param_count:,}",
        _fmt(s.state_bytes),
        f"{_fmt(s.activation_bytes)} ({_count(s.in_flight, 'microbatch')})",
        _fmt(s.memory_bytes),
        s.binding,
    )


def render(plan: Plan) -> str:
    """The plan as the table ``mpar plan`` prints."""
    tp, ep = plan.tensor_parallel_degree, plan.expert_parallel_degree
    cp = plan.context_parallel_degree
    head = (
        f"pipeline plan: {_count(plan.num_ranks, 'rank')} x "
        f"{_count(plan.virtual_stages, 'virtual stage')}, "
        f"{f'tensor parallel x{tp}, ' if tp > 1 else ''}"
        f"{f'expert parallel x{ep}, ' if ep > 1 else ''}"
        f"{f'context parallel x{cp} ({plan.context_parallel_method}), ' if cp > 1 else ''}"
        f"{_count(plan.microbatches, 'microbatch')}, {_schedule(plan)}, method={plan.method}, "
        f"memory_weight={plan.memory_weight:g}"
    )
    rows = [_COLUMNS, *(_row(s) for s in plan.stages)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [
        f"stage {s.stage} also holds {', '.join(s.outer_params)} (outside every unit)"
        for s in plan.stages
        if s.outer_params
    ]
    lines += _gather_note(plan.layout, plan.pipeline)
    lines += _tp_note(plan)
    lines += _ep_note(plan)
    lines += _cp_note(plan)
    lines += _host_note(plan)
    lines += _split_note(plan)
    return "\n".join([*lines, "", _summary(plan)])


def _summary(plan: Plan) -> str:
    cap = "none" if plan.device_memory is None else _fmt(plan.device_memory)
    peak = max(plan.rank_memory_bytes) if plan.rank_memory_bytes else 0
    source = "simulated" if plan.simulated else "formula"
    link = "not modelled" if plan.link_bandwidth is None else f"{_fmt(plan.link_bandwidth)}/s"
    return (
        f"predicted step time {plan.step_time_s * 1e3:.4g} ms, bubble {plan.bubble:.1%} ({source}); "
        f"{_microbatch_note(plan)}busiest rank memory {_fmt(peak)} on the "
        f"{plan.layout.device} device (incl. {_fmt(plan.process_bytes)} assumed for the "
        "process besides tensors: runtime, allocator; set it with --process-memory; "
        f"cap {cap}); bound by {plan.binding}; "
        f"links {link}"
    )


def _count(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless one ("1 sample", "4 microbatches")."""
    return f"{n} {noun if n == 1 else noun + ('es' if noun.endswith('ch') else 's')}"


def _schedule(plan: Plan) -> str:
    """The schedule as it runs: interleaved with one virtual stage is 1F1B."""
    if plan.pipeline == "interleaved" and plan.virtual_stages == 1:
        return "1F1B (interleaved with 1 virtual stage)"
    return plan.pipeline


def _gather_note(layout: MemoryLayout, pipeline: str) -> list[str]:
    """A line saying how ZeRO 2/3 gathers inside a stage, where it matters."""
    gather = layout.gather
    if layout.zero_stage < 2 or gather == "unit":
        return []
    how = "the whole stage" if gather == "chunk" else f"groups of {gather} units"
    why = " (the schedule splits the backward)" if effective_gather(pipeline) == "chunk" else ""
    return [f"ZeRO-{layout.zero_stage} gathers and reduces by {how}{why}"]


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


def _ep_note(plan: Plan) -> list[str]:
    """What expert parallelism does to the figures, when it is on."""
    ep = plan.expert_parallel_degree
    if ep == 1:
        return []
    link = "not modelled" if plan.ep_bandwidth is None else f"{_fmt(plan.ep_bandwidth)}/s"
    sent = _fmt(max(plan.ep_comm_bytes, default=0))
    return [
        f"expert parallel x{ep}: figures are one ep rank's (its experts 1/{ep}, their "
        f"ZeRO state over the {plan.layout.data_parallel_degree // ep} rank(s) holding the "
        f"same experts); expert all-to-alls send {sent} per rank per step over {link} "
        "(in each stage's time ms)"
    ]


def _cp_note(plan: Plan) -> list[str]:
    """What context parallelism does to the figures, when it is on."""
    cp = plan.context_parallel_degree
    if cp == 1:
        return []
    link = "not modelled" if plan.cp_bandwidth is None else f"{_fmt(plan.cp_bandwidth)}/s"
    sent = _fmt(max(plan.cp_comm_bytes, default=0))
    return [
        f"context parallel x{cp} ({plan.context_parallel_method}): figures are one CP rank's "
        f"(activations, outputs and per-sample time 1/{cp}; ZeRO shards and gradients "
        f"reduce over dp x cp = {plan.layout.data_parallel_degree}); attention sends {sent} "
        f"per rank per step over {link} (in each stage's time ms)"
    ]


def _microbatch_note(plan: Plan) -> str:
    scale = plan.layout.microbatch_scale
    if plan.microbatch_size is None:
        return f"microbatch: the profiled one x{scale:g}; "
    return f"microbatch: {_count(plan.microbatch_size, 'sample')} (profile x{scale:g}); "


def _host_note(plan: Plan) -> list[str]:
    """Where offloaded state lives, when there is any."""
    host = max(plan.host_memory_bytes, default=0)
    if not host:
        return []
    if plan.layout.device == "cpu":
        return [
            f"offloaded state {_fmt(host)} per rank stays in the same memory on a CPU device "
            "(counted in the rank's memory): offload saves nothing there"
        ]
    return [f"host memory per rank (offloaded state, pinned): {_fmt(host)}, beside the device's"]
