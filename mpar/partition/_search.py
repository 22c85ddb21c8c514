"""The auto-planner: the whole layout for a memory budget, from one profile (pure).

``search`` enumerates, for ``world_size`` ranks and a global batch:

* tensor-parallel degree ``tp``: the divisors of the world size that the model's
  TP plan accepts (heads and split sizes divisible, ``TPSplits.degrees``); a model
  without a plan gets ``tp = 1`` only. Each degree is laid out from one TP rank's
  share of the profile (``mpar.partition._tp_share.tp_share``: split parameters and
  activations ``1/tp``, TP collectives added to each unit's time);
* expert-parallel degree ``ep`` (a mixture-of-experts model: ``inputs.ep_splits``):
  the divisors of ``dp`` that divide every MoE layer's expert count
  (``EPSplits.degrees``), laid out from one ep rank's share (``mpar.partition._ep_share``:
  its experts ``1/ep``, their ZeRO state over ``dp / ep`` ranks, the all-to-alls added
  to each unit's time); ``ep = 1`` for other models;
* context-parallel degree ``cp``, when the sequence is long (at least
  ``SearchSpace.min_cp_sequence`` tokens) and the model's attention was found
  (``PlanInputs.cp_attention``): the divisors of ``world / tp`` that the sequence
  (``2 cp`` chunks) and, for all-to-all, the heads allow. Each degree is laid out from
  one CP rank's share (``mpar.partition._cp_share.cp_share``: activations and
  per-sample time ``1/cp``, attention traffic added to each unit's time, ZeRO over
  dp x cp). At the same time and memory a candidate without cp is preferred, so cp
  wins where one sequence's activations overflow the cap and dp cannot help. A layout
  at ``cp > 1`` whose microbatch holds whole samples per CP rank (``cp`` divides the
  microbatch size) is dominated by the same layout at ``cp = 1`` with ``dp x cp``
  replicas (same tokens per rank and microbatch, same state, no attention traffic) and
  is not laid out (counted as ``CP_DOMINATED``) when the space leaves cp free;
  Context and expert parallelism are not combined (the config refuses both above 1):
  layouts with ``cp > 1`` and ``ep > 1`` are skipped;
* pipeline degree ``pp``: the divisors of ``world / (tp * cp)`` (``dp = world / (pp *
  tp * cp)``; the global batch must split evenly over the ``dp`` replicas);
* microbatches ``m``: the divisors of the per-replica batch, so every microbatch
  has the same whole number of samples;
* schedule (``interleaved`` 1F1B, ``simple`` GPipe; ``zero_bubble`` and ``zbv`` on
  request) and virtual stages ``v`` (interleaved and zero_bubble with ``v > 1`` need
  ``m`` a multiple of ``pp``; zbv needs ``v = 2``);
* ZeRO stage 0-3, optimizer offload (ZeRO >= 1), parameter offload (ZeRO-3),
  activation checkpointing, bf16.

Each candidate is laid out with the partition solver (fastest split under the
per-rank cap, ``mpar.partition.make_plan``'s memory and time model) from the
*one* profile, scaled linearly to the candidate's microbatch size, with the ZeRO
2/3 gathering the runtime will use (``effective_gather``: split-backward schedules
gather by chunk). Candidates
over the cap are rejected with the reason counted; the fitting ones are ranked
by predicted step time: the busiest rank's work is a lower bound of the
pipeline's makespan, so only candidates whose bound can still beat the
``top``-th best are simulated. Ties go to the smaller per-rank peak.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, get_args

from mpar._size import parse_bytes
from mpar.config._schema import BlockCheckpointing, CheckpointingKind
from mpar.errors import PartitionError
from mpar.partition._cost import CostModel
from mpar.partition._cp_share import cp_comm_s, cp_refusal, cp_share
from mpar.partition._ep_share import EPSplits, ep_comm_s, ep_share
from mpar.partition._memory_model import Checkpointing, unit_state_bytes
from mpar.partition._plan_inputs import ConfigDict, PlanInputs, config_dict
from mpar.partition._planner import (
    UnitCache,
    lay_out,
    moe_layers,
    process_bytes,
    rank_overheads,
    unit_time,
)
from mpar.partition._prediction import lower_bound_s, predict
from mpar.partition._tp_share import TPSplits, tp_comm_s, tp_share
from mpar.schedule import least_active_microbatches
from mpar.topology import GridShape

if TYPE_CHECKING:
    from mpar.config import PrecisionKind
    from mpar.profile import ModelProfile

__all__ = [
    "CHECKPOINTING",
    "HEADROOM",
    "Candidate",
    "SearchResult",
    "SearchSpace",
    "fit_fixed_times",
    "render",
    "search",
    "space_around",
]

CHECKPOINTING: tuple[Checkpointing, ...] = (
    (False, True, "block") if "block" in get_args(CheckpointingKind) else (False, True)
)
"""What the search tries by default: "block" once the config (the runtime) takes it."""

HEADROOM = 0.1
"""The share of the memory cap the search keeps free. The memory model's error on the
CPU, measured (docs/planning.md): a 23M-parameter model picked at 4 ranks under 200 MiB
was predicted at 190 MiB and peaked at 207 MiB (9% over its prediction); at 250 and 300
MiB, 205 vs 191 and 204 vs 214."""

OVER_CAP = "over memory cap"
BATCH = "global batch not divisible by the data-parallel degree"
UNITS = "more stages than units"
MULTIPLE = "interleaved with virtual stages needs microbatches a multiple of pp"
ZBV = "zbv needs exactly 2 virtual stages"
SEARCHABLE = ("interleaved", "simple", "zero_bubble", "zbv")
NO_DP = "ZeRO without data parallelism or offload shards nothing"
SLOWER = "slower than the top candidates (not simulated)"
UNLAID = "slower than the top candidates by their work alone (not laid out)"
OVER_HOST = "over host memory cap"
CPU_OFFLOAD = "offload on a CPU device (the host is the device: it saves nothing)"
TP_REFUSED = "tensor-parallel degree the model's plan refuses (heads or sizes not divisible)"
NO_TP_PLAN = "tensor-parallel degree > 1 for a model without a TP plan"
TP_PP = "pipeline degree that does not divide world / tp"
ACTIVE = "active_microbatches the schedule cannot run with (above m, or below its least)"
EP_REFUSED = "expert-parallel degree that does not divide dp or the experts per layer"
CP_REFUSED = "context-parallel degree the model cannot split by (sequence, heads, attention)"
CP_WITH_EP = "context and expert parallelism together (not supported yet)"
CP_DOMINATED = (
    "context parallelism over whole samples (the same layout at cp 1 with dp x cp is as "
    "small and faster)"
)

Shape = tuple[int, int, int, str, int]
"""(pp, dp, microbatches, pipeline, virtual stages) of a candidate."""
Knobs = tuple[int, bool, bool, Checkpointing, "PrecisionKind"]
"""(ZeRO stage, offload optimizer, offload params, checkpointing, precision)."""


@dataclass(frozen=True)
class SearchSpace:
    """Which values of each knob the search may pick."""

    pipelines: tuple[str, ...] = ("interleaved", "simple")
    pipeline_degrees: tuple[int, ...] | None = None
    """None: every divisor of the world size."""
    max_virtual_stages: int = 4
    max_microbatches: int | None = None
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload: bool = True
    checkpointing: tuple[Checkpointing, ...] = field(default_factory=lambda: CHECKPOINTING)
    """Of False, True (by stage chunk) and "block" (each unit recomputed alone)."""
    precisions: tuple[PrecisionKind, ...] = ("fp32", "bf16")
    virtual_stage_choices: tuple[int, ...] | None = None
    """Only these virtual-stage counts (None: 1 to ``max_virtual_stages``)."""
    microbatch_choices: tuple[int, ...] | None = None
    """Only these microbatch counts (None: every divisor of the per-replica batch)."""
    offload_choices: tuple[tuple[bool, bool], ...] | None = None
    """Only these (offload optimizer, offload params) pairs (None: what ``offload`` allows)."""
    tensor_parallel_degrees: tuple[int, ...] | None = None
    """Only these TP degrees (None: every divisor of the world size the model's plan
    accepts; 1 without a plan)."""
    expert_parallel_degrees: tuple[int, ...] | None = None
    """Only these ep degrees (None: every divisor of dp that the model's expert counts
    take; 1 without experts)."""
    context_parallel_degrees: tuple[int, ...] | None = None
    """Only these CP degrees (None: 1, and where the sequence has at least
    ``min_cp_sequence`` tokens every divisor of ``world / tp`` the model's attention
    allows)."""
    min_cp_sequence: int = 2048
    """Shortest sequence for which context parallelism is searched (without
    ``context_parallel_degrees``): below it activations rarely dominate and the
    attention traffic costs more than it saves."""

    def __post_init__(self) -> None:
        bad = [p for p in self.pipelines if p not in SEARCHABLE]
        if bad or not self.pipelines:
            raise PartitionError(
                f"pipelines must be a non-empty subset of {', '.join(SEARCHABLE)}; got "
                f"{self.pipelines} (a schedule CSV fixes the layout: plan it with make_plan)"
            )
        if self.max_virtual_stages < 1:
            raise PartitionError(f"max_virtual_stages must be >= 1, got {self.max_virtual_stages}")
        if not set(self.zero_stages) <= {0, 1, 2, 3} or not self.zero_stages:
            raise PartitionError(f"zero_stages must be within 0-3, got {self.zero_stages}")
        allowed = (False, True, "block")
        if not self.checkpointing or not all(
            c in allowed or isinstance(c, BlockCheckpointing) for c in self.checkpointing
        ):
            raise PartitionError(
                "checkpointing must be within False, True, 'block' or BlockCheckpointing "
                f"strategies; got {self.checkpointing}"
            )
        if not set(self.precisions) <= {"fp32", "bf16", "fp16"} or not self.precisions:
            raise PartitionError(
                f"precisions must be within fp32, bf16, fp16; got {self.precisions}"
            )


@dataclass
class Candidate:
    """One layout, as the run it describes (``inputs``), with its predicted cost
    (``step_time_s`` None until simulated)."""

    inputs: PlanInputs
    """The run: grid, schedule, ZeRO, precision, checkpointing, device (``make_plan``
    plans it; ``config()`` is its config)."""
    microbatch_size: int
    max_rank_memory_bytes: int
    rank_memory_bytes: list[int]
    boundaries: list[int]
    lower_bound_s: float
    overhead_s: float
    step_time_s: float | None = None
    bubble: float | None = None
    host_memory_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank: host bytes of offloaded state (inside ``rank_memory_bytes`` on a
    CPU device, beside it elsewhere)."""

    @property
    def pipeline_parallel_degree(self) -> int:
        return self.inputs.grid.pp

    @property
    def data_parallel_degree(self) -> int:
        return self.inputs.grid.dp

    @property
    def tensor_parallel_degree(self) -> int:
        """Ranks splitting each layer; the memory figures are one TP rank's."""
        return self.inputs.grid.tp

    @property
    def expert_parallel_degree(self) -> int:
        """Ranks splitting each MoE layer's experts (folded into dp)."""
        return self.inputs.grid.ep

    @property
    def context_parallel_degree(self) -> int:
        """Ranks splitting each sequence; the figures are one CP rank's."""
        return self.inputs.grid.cp

    @property
    def virtual_stages(self) -> int:
        return self.inputs.schedule.virtual_stages

    @property
    def microbatches(self) -> int:
        return self.inputs.schedule.microbatches

    @property
    def pipeline(self) -> str:
        return self.inputs.schedule.pipeline

    @property
    def zero_stage(self) -> int:
        return self.inputs.zero.stage

    @property
    def offload_optimizer(self) -> bool:
        return self.inputs.zero.offload_optimizer

    @property
    def offload_params(self) -> bool:
        return self.inputs.zero.offload_params

    @property
    def activation_checkpointing(self) -> Checkpointing:
        return self.inputs.activation_checkpointing

    @property
    def precision(self) -> PrecisionKind:
        return self.inputs.precision

    @property
    def max_host_memory_bytes(self) -> int:
        return max(self.host_memory_bytes, default=0)

    def config(self) -> ConfigDict:
        """The candidate as an mpar config dict (``mpar.config.load_config`` reads it;
        ``mpar.partition.plan_inputs`` turns it back into ``inputs``)."""
        return config_dict(self.inputs)

    def to_dict(self) -> dict[str, object]:
        i = self.inputs
        return {
            "pipeline_parallel_degree": i.grid.pp,
            "data_parallel_degree": i.grid.dp,
            "virtual_stages": i.schedule.virtual_stages,
            "microbatches": i.schedule.microbatches,
            "microbatch_size": self.microbatch_size,
            "pipeline": i.schedule.pipeline,
            "zero_stage": i.zero.stage,
            "offload_optimizer": i.zero.offload_optimizer,
            "offload_params": i.zero.offload_params,
            "activation_checkpointing": i.activation_checkpointing,
            "precision": i.precision,
            "max_rank_memory_bytes": self.max_rank_memory_bytes,
            "rank_memory_bytes": list(self.rank_memory_bytes),
            "boundaries": list(self.boundaries),
            "lower_bound_s": self.lower_bound_s,
            "overhead_s": self.overhead_s,
            "step_time_s": self.step_time_s,
            "bubble": self.bubble,
            "gather": i.zero.gather,
            "device": i.device,
            "host_memory_bytes": list(self.host_memory_bytes),
            "tensor_parallel_degree": i.grid.tp,
            "expert_parallel_degree": i.grid.ep,
            "context_parallel_degree": i.grid.cp,
            "max_host_memory_bytes": self.max_host_memory_bytes,
        }


@dataclass
class SearchResult:
    """Fitting candidates ranked best first, and how many layouts were rejected and why."""

    ranked: list[Candidate]
    rejected: dict[str, int]
    evaluated: int
    fitting: int
    world_size: int
    global_batch: int
    device_memory: int
    profile_batch: int
    cost: CostModel
    space: SearchSpace
    notes: list[str] = field(default_factory=list)
    device: str = "cuda"
    host_memory: int | None = None
    """The cap on each rank's host memory (None: none)."""
    tp_degrees: tuple[int, ...] = (1,)
    """The TP degrees searched."""
    cp_degrees: tuple[int, ...] = (1,)
    """The CP degrees searched."""
    ep_degrees: tuple[int, ...] = (1,)
    """The ep degrees searched."""
    headroom: float = 0.0
    """The share of ``device_memory`` kept free: candidates fit ``device_memory x (1 -
    headroom)``."""
    alternatives: list[Candidate] = field(default_factory=list)
    """The fastest fitting layout of each (tp, pp, ZeRO-3 or not) family that is not
    in ``ranked``, fastest first."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (the sequence length), for tokens/s; None: not known."""
    peak_flops: float | None = None
    """The device's bf16 peak FLOP/s, for the model FLOPs utilisation; None: not known."""
    flops_per_sample: float = 0.0
    """The model's forward and backward FLOPs per sample (no recomputation)."""

    def _candidate_dicts(self) -> list[dict[str, object]]:
        """The ranked candidates, then each family's fastest outside them."""
        return [
            {
                **c.to_dict(),
                "family_best": i >= len(self.ranked),
                "tokens_per_s_per_device": self.tokens_per_s_per_device(c),
                "mfu": self.mfu(c),
            }
            for i, c in enumerate([*self.ranked, *self.alternatives])
        ]

    def tokens_per_s_per_device(self, c: Candidate) -> float | None:
        """Tokens a second per device at ``c``'s predicted step time."""
        if self.tokens_per_sample is None or not c.step_time_s:
            return None
        return self.global_batch * self.tokens_per_sample / c.step_time_s / self.world_size

    def mfu(self, c: Candidate) -> float | None:
        """Model FLOPs utilisation of the bf16 peak at ``c``'s predicted step time."""
        if self.peak_flops is None or not c.step_time_s or not self.flops_per_sample:
            return None
        per_device = self.global_batch * self.flops_per_sample / self.world_size
        return per_device / c.step_time_s / self.peak_flops

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise PartitionError(_nothing_fits(self))
        return self.ranked[0]

    def __str__(self) -> str:
        return render(self)

    def to_dict(self) -> dict[str, object]:
        best = self.best
        return {
            "config": best.config(),
            "tensor_parallel_degree": best.tensor_parallel_degree,
            "tp_degrees": list(self.tp_degrees),
            "expert_parallel_degree": best.expert_parallel_degree,
            "ep_degrees": list(self.ep_degrees),
            "context_parallel_degree": best.context_parallel_degree,
            "cp_degrees": list(self.cp_degrees),
            "predicted": {
                "step_time_s": best.step_time_s,
                "bubble": best.bubble,
                "max_rank_memory_bytes": best.max_rank_memory_bytes,
                "rank_memory_bytes": best.rank_memory_bytes,
                "max_host_memory_bytes": best.max_host_memory_bytes,
                "host_memory_bytes": best.host_memory_bytes,
                "microbatch_size": best.microbatch_size,
            },
            "device": self.device,
            "device_memory": self.device_memory,
            "headroom": self.headroom,
            "host_memory": self.host_memory,
            "candidates": self._candidate_dicts(),
            "rejected": dict(self.rejected),
            "evaluated": self.evaluated,
            "fitting": self.fitting,
            "cost_model": asdict(self.cost),
        }


def fit_fixed_times(
    profile: ModelProfile, batch: int, other: ModelProfile, other_batch: int
) -> ModelProfile:
    """``profile`` with each unit's per-call fixed time fitted from a second profile.

    Unit time is taken as ``fixed + per_sample * samples`` through the two
    measurements (clamped to ``0 <= fixed <= time``); the search then scales only
    the per-sample part with the microbatch size. Without it, time is linear.
    """
    if batch == other_batch or [u.name for u in profile.units] != other.names:
        raise PartitionError(
            "fit_fixed_times needs two profiles of the same units at different batch sizes"
        )
    units = []
    for u, w in zip(profile.units, other.units):
        slope = (w.time_s - u.time_s) / (other_batch - batch)
        fixed = min(max(u.time_s - slope * batch, 0.0), u.time_s)
        units.append(dataclasses.replace(u, fixed_time_s=fixed))
    return dataclasses.replace(profile, units=units)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _knobs(
    dp: int, space: SearchSpace, reject: Counter[str], device: str = "cuda"
) -> Iterator[Knobs]:
    """(zero stage, offload optimizer, offload params, checkpointing, precision) to try.

    On a CPU device offload is only tried where ``space.offload_choices`` asks for it
    (the host is the device: offloaded state stays in the same memory, plus a host
    gradient), else counted as rejected."""
    for zero in space.zero_stages:
        offloads = [(False, False)]
        if (space.offload or space.offload_choices) and zero >= 1:
            offloads.append((True, False))
        if (space.offload or space.offload_choices) and zero == 3:
            offloads += [(False, True), (True, True)]
        if space.offload_choices is not None:
            offloads = [o for o in offloads if o in space.offload_choices]
        elif device == "cpu" and len(offloads) > 1:
            reject[CPU_OFFLOAD] += (
                (len(offloads) - 1) * len(space.checkpointing) * len(space.precisions)
            )
            offloads = offloads[:1]
        for opt, par in offloads:
            if dp == 1 and zero >= 1 and not (opt or par):
                reject[NO_DP] += len(space.checkpointing) * len(space.precisions)
                continue
            for ckpt, precision in itertools.product(space.checkpointing, space.precisions):
                yield zero, opt, par, ckpt, precision


def _shapes(
    units: int, world: int, batch: int, space: SearchSpace, reject: Counter[str]
) -> Iterator[Shape]:
    """(pp, dp, m, pipeline, v) to try; the rest counted in ``reject``."""
    for pp in space.pipeline_degrees or _divisors(world):
        if world % pp:
            raise PartitionError(f"pipeline degree {pp} does not divide the world size {world}")
        dp = world // pp
        if batch % dp:
            reject[BATCH] += 1
            continue
        for m in _divisors(batch // dp):
            if space.max_microbatches is not None and m > space.max_microbatches:
                continue
            if space.microbatch_choices is not None and m not in space.microbatch_choices:
                continue
            pipelines = space.pipelines[:1] if pp == 1 else space.pipelines
            for pipeline in pipelines:
                for v in _virtual_choices(pp, space):
                    if pp * v > units:
                        reject[UNITS] += 1
                    elif pipeline == "zbv" and v != 2:
                        reject[ZBV] += 1
                    elif pipeline in ("interleaved", "zero_bubble") and v > 1 and m % pp:
                        reject[MULTIPLE] += 1
                    else:
                        yield pp, dp, m, pipeline, v


def _virtual_choices(pp: int, space: SearchSpace) -> list[int]:
    if space.virtual_stage_choices is not None:
        return list(space.virtual_stage_choices)
    return list(range(1, (space.max_virtual_stages if pp > 1 else 1) + 1))


def _runs(base: PlanInputs, shape: Shape) -> bool:
    """Whether the schedule of ``shape`` runs with the cap ``base`` keeps (if any)."""
    pp, _dp, m, pipeline, v = shape
    cap = base.schedule.active_microbatches
    return cap is None or least_active_microbatches(pipeline, pp, v) <= cap <= m


def _inputs(
    base: PlanInputs, shape: Shape, knobs: Knobs, tp: int, ep: int = 1, cp: int = 1
) -> PlanInputs:
    """The run of one candidate: ``base`` (device, its memory, the TP splits, the ZeRO
    gather and bucket, the cap and split backward) with the candidate's knobs, laid
    out for speed under the cap (memory weight 0)."""
    pp, dp, m, pipeline, v = shape
    zero, opt, par, ckpt, precision = knobs
    return dataclasses.replace(
        base,
        grid=GridShape(pp=pp, dp=dp, tp=tp, ep=ep, cp=cp),
        schedule=dataclasses.replace(
            base.schedule, pipeline=pipeline, virtual_stages=v, microbatches=m
        ),
        zero=dataclasses.replace(base.zero, stage=zero, offload_optimizer=opt, offload_params=par),
        precision=precision,
        activation_checkpointing=ckpt,
        optimize="speed",
        memory_weight=0.0,
    )


def _evaluate(
    profile: ModelProfile,
    inputs: PlanInputs,
    size: int,
    scale: float,
    cost: CostModel,
    cache: UnitCache,
) -> Candidate | None:
    """Lay out one candidate (``profile``: one TP rank's); None when it does not fit."""
    cap = inputs.device_memory or 0
    try:
        laid = lay_out(profile, inputs, cost=cost, microbatch_scale=scale, cache=cache)
    except PartitionError:
        return None
    if max(laid.rank_memory) > cap:
        return None
    overhead = max(rank_overheads(laid.stages, inputs, laid.layout, cost, profile.units))
    s = inputs.schedule
    bound = (
        lower_bound_s(
            laid.stages, inputs.grid.pp, s.microbatches, bool(inputs.activation_checkpointing), cost
        )
        + overhead
    )
    return Candidate(
        inputs, size, max(laid.rank_memory), laid.rank_memory, laid.starts, bound, overhead,
        host_memory_bytes=laid.host_memory,
    )  # fmt: skip


def _simulate(
    profile: ModelProfile, c: Candidate, scale: float, cost: CostModel, cache: UnitCache
) -> None:
    laid = lay_out(profile, c.inputs, cost=cost, microbatch_scale=scale, cache=cache)
    makespan, bubble = predict(laid.stages, c.inputs, cost)
    c.step_time_s, c.bubble = makespan + c.overhead_s, bubble


class _Top:
    """The ``top`` fastest candidates so far (simulated)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.heap: list[tuple[float, int, int, Candidate]] = []  # max-heap of (-time, -mem, -order)

    @property
    def worst(self) -> float:
        """The slowest kept step time (infinite until ``top`` are kept): a layout whose
        lower bound is above it cannot enter."""
        return -self.heap[0][0] if len(self.heap) >= self.top else math.inf

    def add(self, cand: Candidate, order: int) -> None:
        key = (-(cand.step_time_s or 0.0), -cand.max_rank_memory_bytes, -order, cand)
        if len(self.heap) < self.top:
            heapq.heappush(self.heap, key)
        elif key[:3] > self.heap[0][:3]:
            heapq.heapreplace(self.heap, key)

    def ranked(self) -> list[Candidate]:
        return sorted((k[3] for k in self.heap), key=_preference)


Family = tuple[int, int, bool]
"""(tp, pp, ZeRO-3): the layouts the field compares, e.g. TP=8 with FSDP (pp = 1,
ZeRO-3) and TP=8 with a pipeline; the search keeps the fastest fitting one of each."""


def _family(run: PlanInputs) -> Family:
    return run.grid.tp, run.grid.pp, run.zero.stage == 3


class _Ranking:
    """The overall top and each family's fastest, fed in lower-bound order."""

    def __init__(self, top: int, todo: Sequence[Layout], cache: UnitCache) -> None:
        self.best = _Top(top)
        self.families = {_family(run): _Top(1) for _b, run, _s, _x in todo}
        self.skipped = 0
        self.cache = cache

    def limit(self, run: PlanInputs) -> float:
        """The bound above which ``run`` can enter neither the top nor its family's."""
        return max(self.best.worst, self.families[_family(run)].worst)

    @property
    def done(self) -> float:
        """The bound above which no layout can enter anything."""
        return max([self.best.worst, *(f.worst for f in self.families.values())])

    def offer(
        self, profile: ModelProfile, cand: Candidate, scale: float, order: int, cost: CostModel
    ) -> None:
        if cand.lower_bound_s > self.limit(cand.inputs):
            self.skipped += 1
            return
        _simulate(profile, cand, scale, cost, self.cache)
        self.best.add(cand, order)
        self.families[_family(cand.inputs)].add(cand, order)

    def alternatives(self) -> list[Candidate]:
        """Each family's fastest that is not in the top, fastest first."""
        ranked = {id(c) for c in self.best.ranked()}
        kept = [c for f in self.families.values() for c in f.ranked() if id(c) not in ranked]
        return sorted(kept, key=_preference)


def _checkpointing_order(c: Checkpointing) -> int:
    """Simpler first: off, by chunk, every block, then the finer per-block strategies."""
    if isinstance(c, BlockCheckpointing):
        return 3
    return 2 if c == "block" else int(c)


def checkpointing_label(c: Checkpointing) -> str:
    """How the plan table names ``c``: "-", "chunk", "block", "block/2", "selective"."""
    if isinstance(c, BlockCheckpointing):
        every = f"/{c.every}" if c.every > 1 else ""
        return f"{c.mode}{every}"
    if c == "block":
        return "block"
    return "chunk" if c else "-"


def _preference(c: Candidate) -> tuple[float, ...]:
    """Faster first; at equal time (to 1e-9) the smaller peak, then the simpler layout."""
    time = float(f"{c.step_time_s or 0.0:.9g}")
    features = (
        c.context_parallel_degree,
        c.tensor_parallel_degree,
        c.expert_parallel_degree,
        c.zero_stage,
        c.offload_optimizer + c.offload_params,
        _checkpointing_order(c.activation_checkpointing),
    )
    return (time, c.max_rank_memory_bytes, *features, c.virtual_stages)


def search(
    profile: ModelProfile,
    inputs: PlanInputs,
    *,
    global_batch: int,
    profile_batch: int = 1,
    space: SearchSpace | None = None,
    cost: CostModel | None = None,
    top: int = 10,
    host_memory: int | str | None = None,
    headroom: float = HEADROOM,
) -> SearchResult:
    """Search every layout of ``inputs.grid.world_size`` ranks for ``global_batch``
    samples a step.

    Args:
        profile: one profile of the model at ``profile_batch`` samples per microbatch.
        inputs: what stays fixed (``PlanInputs``): the world size (its grid's), the cap
            ``device_memory`` (required), the device kind (on "cpu" offloaded state
            counts in the rank's memory and offload is not tried unless
            ``space.offload_choices`` names it), the model's ``tp_splits`` (None: no
            plan, ``tp = 1`` only), ZeRO's gather and bucket, ``active_microbatches``
            and ``split_backward``. Each candidate is ``inputs`` with its own grid,
            schedule, ZeRO stage, offload, checkpointing and precision.
        space: the knobs' ranges (``SearchSpace``); cost: bandwidths and speed factors.
        top: how many fitting candidates to simulate and rank.
        host_memory: bytes (or "64GiB") of host memory per rank for offloaded state on a
            CUDA or XLA device; None: not capped.
        headroom: the share of ``inputs.device_memory`` kept free for the memory
            model's error (``HEADROOM``): layouts are laid out under, and their configs
            carry, ``device_memory x (1 - headroom)``.

    Returns a ``SearchResult``; ``result.best`` raises ``PartitionError`` when nothing fits.
    """
    space, cost = space or SearchSpace(), cost or CostModel()
    world_size = inputs.grid.world_size
    _check_inputs(inputs, global_batch, profile_batch, top)
    if not 0 <= headroom < 1:
        raise PartitionError(f"headroom must be in [0, 1), got {headroom!r}")
    host_cap = None if host_memory is None else parse_bytes(host_memory)
    cap = inputs.device_memory or 0
    inputs = dataclasses.replace(inputs, device_memory=int(cap * (1 - headroom)))
    reject: Counter[str] = Counter()
    profiles: dict[Axes, ModelProfile] = {}
    todo = _layouts(profile, inputs, global_batch, profile_batch, space, cost, reject, profiles)
    cache = UnitCache()  # per-unit figures shared by the layouts of one profile
    best, evaluated, count = _Ranking(top, todo, cache), 0, 0
    states: dict[tuple[object, ...], float] = {}
    for order, (bound, run, size, scale) in enumerate(todo):
        if bound > best.done:  # this one and every later one is slower than all kept
            reject[UNLAID] += len(todo) - order
            break
        if bound > best.limit(run):
            reject[UNLAID] += 1
            continue
        evaluated += 1
        if _state_bound(profiles[_axes(run)], run, cost, states) > (run.device_memory or 0):
            reject[OVER_CAP] += 1
            continue
        cand = _evaluate(profiles[_axes(run)], run, size, scale, cost, cache)
        if cand is None:
            reject[OVER_CAP] += 1
        elif _over_host(cand, host_cap):
            reject[OVER_HOST] += 1
        else:
            count += 1
            best.offer(profiles[_axes(run)], cand, scale, order, cost)
    if best.skipped:
        reject[SLOWER] += best.skipped
    return SearchResult(
        best.best.ranked(), dict(reject), evaluated, count, world_size, global_batch,
        cap, profile_batch, cost, space, device=inputs.device, headroom=headroom,
        host_memory=host_cap, tp_degrees=tuple(dict.fromkeys(tp for tp, _, _ in profiles)),
        ep_degrees=tuple(sorted({ep for _, ep, _ in profiles})) or (1,),
        cp_degrees=tuple(sorted({cp for _, _, cp in profiles})) or (1,),
        notes=_tp_notes(world_size, space, _splits_of(inputs)),
        alternatives=best.alternatives(),
    )  # fmt: skip


Axes = tuple[int, int, int]
"""(tp, ep, cp): the degrees one rank's share of the profile depends on."""


def _axes(run: PlanInputs) -> Axes:
    return run.grid.tp, run.grid.ep, run.grid.cp


Layout = tuple[float, PlanInputs, int, float]
"""(lower bound of the step time, the run, samples per microbatch, scale of the profile)."""


def _layouts(
    profile: ModelProfile,
    inputs: PlanInputs,
    global_batch: int,
    profile_batch: int,
    space: SearchSpace,
    cost: CostModel,
    reject: Counter[str],
    profiles: dict[Axes, ModelProfile],
) -> list[Layout]:
    """Every layout of the space that can run, with a lower bound of its step time
    (``_work_bound``), cheapest bound first (ties in enumeration order); the others
    counted in ``reject``. Fills ``profiles`` with one TP, EP and CP rank's profile
    per (tp, ep, cp)."""
    world_size, splits = inputs.grid.world_size, _splits_of(inputs)
    experts = inputs.ep_splits or EPSplits()
    todo: list[Layout] = []
    work: dict[tuple[int, int, int, float, bool], float] = {}  # per-unit costs, summed once per key
    for tp, cp in _inner_degrees(world_size, space, inputs, splits, reject):
        inner_space = _space_for(space, world_size // (tp * cp), reject)
        if inner_space is None:
            continue
        share = cp_share(
            tp_share(profile, splits, tp), inputs.cp_attention, cp, _method(inputs), tp
        )
        world = world_size // (tp * cp)
        for shape in _shapes(len(profile.units), world, global_batch, inner_space, reject):
            if not _runs(inputs, shape):
                reject[ACTIVE] += 1
                continue
            size = global_batch // shape[1] // shape[2]
            dominated = _cp_dominated(space, cp, size)
            scale = size / profile_batch
            for ep in _ep_degrees(shape[1], space, experts, reject):
                if cp > 1 and ep > 1:  # refused by the config: not laid out
                    reject[CP_WITH_EP] += 1
                    continue
                if (tp, ep, cp) not in profiles:
                    profiles[tp, ep, cp] = ep_share(share, experts, ep, shape[1])
                for knobs in _knobs(shape[1] * cp, space, reject, inputs.device):
                    if dominated:
                        reject[CP_DOMINATED] += 1
                        continue
                    run = _inputs(inputs, shape, knobs, tp, ep, cp)
                    bound = _work_bound(profiles[tp, ep, cp], run, scale, cost, work)
                    todo.append((bound, run, size, scale))
    order = sorted(range(len(todo)), key=lambda i: todo[i][0])  # stable: ties keep their order
    return [todo[i] for i in order]


def _cp_dominated(space: SearchSpace, cp: int, size: int) -> bool:
    """Whether a layout at ``cp > 1`` with ``size`` samples per microbatch is dominated:
    where ``cp`` divides ``size``, the layout at ``cp = 1`` and ``dp x cp`` replicas with
    the same pp, tp, schedule, microbatches and knobs (searched whenever the space leaves
    cp free) gives each rank the same tokens a microbatch (``size / cp`` whole
    sequences instead of ``size`` sequences' ``1/cp``), so the same activations, state
    (ZeRO over dp x cp either way) and work, without the attention traffic. Context
    parallelism helps only below one sample per rank's microbatch."""
    return cp > 1 and size % cp == 0 and space.context_parallel_degrees is None


def _state_bound(
    profile: ModelProfile, run: PlanInputs, cost: CostModel, states: dict[tuple[object, ...], float]
) -> float:
    """A lower bound of ``run``'s busiest rank before laying it out: its process and
    the ranks' average state (parameters, gradients, optimizer; ``unit_state_bytes``).
    ``states`` caches the units' summed state per (tp, ep, cp, dp, ZeRO, offload,
    precision)."""
    z = run.zero
    g = run.grid
    key = (g.tp, g.ep, g.cp, g.dp, z.stage, z.offload_optimizer, z.offload_params, run.precision)
    layout = run.memory_layout(1.0)
    if key not in states:
        states[key] = math.fsum(unit_state_bytes(u, layout) for u in profile.units)
    return process_bytes(g.pp, cost, layout, moe_layers(run)) + states[key] / g.pp * (1 - 1e-9)


def _work_bound(
    profile: ModelProfile,
    run: PlanInputs,
    scale: float,
    cost: CostModel,
    work: dict[tuple[int, int, int, float, bool], float],
) -> float:
    """A lower bound of ``run``'s step time before laying it out: its ranks' average
    work, ``m`` microbatches of every unit's forward and backward (and recomputation)
    over ``pp`` ranks; the busiest rank's work (``lower_bound_s``) is at least that.
    ``work`` caches the units' summed seconds per (tp, ep, cp, microbatch scale, mixed)."""
    key = (*_axes(run), scale, run.precision != "fp32")
    if key not in work:
        layout = run.memory_layout(scale)
        s = scale * layout.dtype_factor
        comm = [
            tp_comm_s(u, s, cost.tp_bandwidth)
            + ep_comm_s(u, s, cost.ep_bandwidth)
            + cp_comm_s(u, scale, layout.dtype_factor, cost.cp_bandwidth)
            for u in profile.units
        ]
        work[key] = math.fsum(unit_time(u, layout, cost) + t for u, t in zip(profile.units, comm))
    recompute = cost.recompute_fraction if run.activation_checkpointing else 0.0
    per_rank = run.schedule.microbatches * (1 + recompute) * work[key] / run.grid.pp
    return per_rank * (1 - 1e-9)  # below the stages' own sums whatever their rounding


def _splits_of(inputs: PlanInputs) -> TPSplits:
    return inputs.tp_splits or TPSplits.none()


def _over_host(cand: Candidate, host_cap: int | None) -> bool:
    """Over the host-memory cap (on a CUDA or XLA device: on a CPU one the host is the
    device, capped by ``device_memory``)."""
    on_host = cand.inputs.device != "cpu"
    return host_cap is not None and on_host and cand.max_host_memory_bytes > host_cap


def space_around(inputs: PlanInputs, auto: Collection[str]) -> SearchSpace:
    """The search space of a run whose config gives ``inputs`` except the keys ``auto``
    (``microbatches``, ``virtual_stages``, ``zero.stage``, ``activation_checkpointing``):
    every other knob fixed to its value, the grid included."""
    zero = inputs.zero
    offload = (zero.offload_optimizer, zero.offload_params)
    if "zero.stage" not in auto:
        stages: tuple[int, ...] = (zero.stage,)
    else:
        stages = (3,) if offload[1] else (1, 2, 3) if offload[0] else (0, 1, 2, 3)
    checkpointing = inputs.activation_checkpointing
    s = inputs.schedule
    return SearchSpace(
        pipelines=(s.pipeline,),
        pipeline_degrees=(inputs.grid.pp,),
        zero_stages=stages,
        offload_choices=(offload,),
        checkpointing=CHECKPOINTING if "activation_checkpointing" in auto else (checkpointing,),
        precisions=(inputs.precision,),
        virtual_stage_choices=None if "virtual_stages" in auto else (s.virtual_stages,),
        microbatch_choices=None if "microbatches" in auto else (s.microbatches,),
        tensor_parallel_degrees=(inputs.grid.tp,),
        expert_parallel_degrees=(inputs.grid.ep,),
        context_parallel_degrees=(inputs.grid.cp,),
    )


def _tp_degrees(
    world: int, space: SearchSpace, splits: TPSplits, reject: Counter[str]
) -> list[int]:
    """TP degrees to search: divisors of ``world`` (or ``space``'s) the plan accepts."""
    wanted = space.tensor_parallel_degrees or tuple(_divisors(world))
    out = []
    for tp in wanted:
        if world % tp:
            raise PartitionError(
                f"tensor-parallel degree {tp} does not divide the world size {world}"
            )
        if tp == 1 or tp in splits.degrees:
            out.append(tp)
        else:
            reject[TP_REFUSED if tp in splits.refused else NO_TP_PLAN] += 1
    return out


def _ep_degrees(dp: int, space: SearchSpace, experts: EPSplits, reject: Counter[str]) -> list[int]:
    """ep degrees to search at ``dp`` data-parallel ranks: divisors of ``dp`` (or
    ``space``'s) that divide every MoE layer's experts."""
    fits = experts.degrees(dp) if experts.experts else [1]
    wanted = space.expert_parallel_degrees or tuple(fits)
    kept = [ep for ep in wanted if ep in fits]
    if len(kept) < len(wanted):
        reject[EP_REFUSED] += len(wanted) - len(kept)
    return kept


def _method(inputs: PlanInputs) -> str:
    return inputs.context_parallel_method


def _inner_degrees(
    world: int, space: SearchSpace, inputs: PlanInputs, splits: TPSplits, reject: Counter[str]
) -> list[tuple[int, int]]:
    """(tp, cp) pairs to search: TP degrees the plan accepts, each with the CP degrees
    that divide what it leaves of ``world`` and that the attention allows."""
    out = []
    for tp in _tp_degrees(world, space, splits, reject):
        for cp in _cp_degrees(world // tp, space, inputs, tp):
            why = cp_refusal(inputs.cp_attention, cp, _method(inputs), tp)
            if why is None:
                out.append((tp, cp))
            else:
                reject[CP_REFUSED] += 1
    return out


def _cp_degrees(world: int, space: SearchSpace, inputs: PlanInputs, tp: int) -> list[int]:
    if space.context_parallel_degrees is not None:
        for cp in space.context_parallel_degrees:
            if world % cp:
                raise PartitionError(
                    f"context-parallel degree {cp} does not divide the world size / tp {world}"
                )
        return list(space.context_parallel_degrees)
    attention = inputs.cp_attention
    if attention is None or attention.sequence < space.min_cp_sequence:
        return [1]
    return _divisors(world)


def _space_for(space: SearchSpace, world: int, reject: Counter[str]) -> SearchSpace | None:
    """``space`` with the pipeline degrees that divide ``world`` (= world / tp); None
    when none does."""
    if space.pipeline_degrees is None:
        return space
    kept = tuple(pp for pp in space.pipeline_degrees if world % pp == 0)
    if len(kept) < len(space.pipeline_degrees):  # a rejection count is never 0
        reject[TP_PP] += len(space.pipeline_degrees) - len(kept)
    return dataclasses.replace(space, pipeline_degrees=kept) if kept else None


def _tp_notes(world: int, space: SearchSpace, splits: TPSplits) -> list[str]:
    """Why TP degrees were left out, one line each."""
    wanted = space.tensor_parallel_degrees or tuple(_divisors(world))
    left = [tp for tp in wanted if tp > 1 and tp not in splits.degrees]
    refused = [tp for tp in left if tp in splits.refused]
    lines = [f"tp {tp} left out: {splits.refused[tp]}" for tp in refused]
    if len(refused) < len(left):
        lines.append(f"tensor parallelism not searched: {splits.source or NO_TP_PLAN}")
    return lines


def _check_inputs(inputs: PlanInputs, global_batch: int, profile_batch: int, top: int) -> None:
    if inputs.device_memory is None:
        raise PartitionError(
            "the search needs inputs.device_memory (bytes per rank): the cap it lays out under"
        )
    for name, value in (
        ("global_batch", global_batch),
        ("profile_batch", profile_batch),
        ("top", top),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PartitionError(f"{name} must be a positive integer, got {value!r}")


def _nothing_fits(result: SearchResult) -> str:
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(result.rejected.items(), key=lambda x: -x[1]))
    return (
        f"no layout of {result.world_size} ranks fits {result.device_memory / 2**30:.2f} GiB per "
        f"rank (less {result.headroom:.0%} headroom) for a global batch of {result.global_batch} ({result.evaluated} layouts tried; "
        f"rejected: {reasons}); {_advice(result)}"
    )


def _advice(result: SearchResult) -> str:
    """What to try, from what the search did not: the savers it left out, then the
    sizes."""
    space, untried = result.space, []
    if result.device == "cpu" and result.rejected.get(CPU_OFFLOAD):
        untried.append(
            "plan for the GPUs it will run on (--cluster or --device cuda: offload frees device memory there)"
        )
    elif not space.offload and space.offload_choices is None:
        untried.append("allow offload to the host")
    if not any(space.checkpointing):
        untried.append("allow activation checkpointing")
    elif "block" not in space.checkpointing:
        untried.append("allow per-block activation checkpointing")
    if "bf16" not in space.precisions:
        untried.append("allow bf16")
    if 3 not in space.zero_stages:
        untried.append("allow ZeRO-3")
    sizes = "use more or larger devices, or a smaller global batch or sequence"
    if not untried:
        return f"every layout had offload, checkpointing, bf16 and ZeRO-3 to choose from: {sizes}"
    return "; ".join(untried) + f"; or {sizes}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def _grid_label(c: Candidate, with_cp: bool) -> str:
    axes = [c.pipeline_parallel_degree, c.data_parallel_degree, c.tensor_parallel_degree]
    if with_cp:
        axes.insert(2, c.context_parallel_degree)
    return "x".join(str(a) for a in axes)


def _row(rank: str, c: Candidate, result: SearchResult) -> tuple[str, ...]:
    offload = "+".join(
        n for n, on in (("opt", c.offload_optimizer), ("param", c.offload_params)) if on
    )
    ep = f" ep{c.expert_parallel_degree}" if c.expert_parallel_degree > 1 else ""
    tokens, mfu = result.tokens_per_s_per_device(c), result.mfu(c)
    return (
        rank,
        _grid_label(c, max(result.cp_degrees) > 1) + ep,
        str(c.virtual_stages),
        f"{c.microbatches}x{c.microbatch_size}",
        _schedule_name(c),
        str(c.zero_stage),
        offload or "-",
        checkpointing_label(c.activation_checkpointing),
        c.precision,
        f"{(c.step_time_s or 0.0) * 1e3:.4g}",
        f"{(c.bubble or 0.0):.1%}",
        _gib(c.max_rank_memory_bytes),
        _gib(c.max_host_memory_bytes) if c.max_host_memory_bytes else "-",
        "-" if tokens is None else f"{tokens:.4g}",
        "-" if mfu is None else f"{mfu:.1%}",
    )


def _schedule_name(c: Candidate) -> str:
    """The schedule as it runs: interleaved with one virtual stage is 1F1B, one stage
    has no pipeline."""
    if c.pipeline_parallel_degree == 1:
        return "none"
    if c.pipeline == "interleaved" and c.virtual_stages == 1:
        return "1f1b"
    return c.pipeline


def render(result: SearchResult) -> str:
    """The ranked candidates as a table, with the rejection counts."""
    host = "" if result.host_memory is None else f", host {_gib(result.host_memory)} GiB"
    head = (
        f"auto plan: {result.world_size} ranks x {_gib(result.device_memory)} GiB "
        f"({result.device}{host}; laid out under {_gib(_usable(result))} GiB, "
        f"{result.headroom:.0%} headroom), global batch {result.global_batch}; "
        f"{result.evaluated} layouts laid out, {result.fitting} fit"
    )
    with_cp = max(result.cp_degrees) > 1
    rows = [
        ("#", "pp x dp x cp x tp" if with_cp else "pp x dp x tp", "v", "m x size", "schedule",
         "zero", "offload", "ckpt", "precision", "step ms", "bubble", "peak GiB", "host GiB",
         "tok/s/dev", "MFU"),
        *(_row(str(i + 1), c, result) for i, c in enumerate(result.ranked)),
        *(_row("+", c, result) for c in result.alternatives),
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if not result.ranked:
        lines.append("(nothing fits)")
    if result.alternatives:
        lines.append(
            "+: the fastest of its family (tp and pp degrees, ZeRO-3 or not) outside the top"
        )
    lines += result.notes
    lines += ["", "rejected:"]
    lines += [f"  {n:>6}  {r}" for r, n in sorted(result.rejected.items(), key=lambda x: -x[1])]
    cost = result.cost
    lines += [
        "",
        f"cost model: links {cost.link_bandwidth}, dp {cost.dp_bandwidth}, tp "
        f"{cost.tp_bandwidth}, {_ep_bandwidth(result)}"
        f"{f'cp {cost.cp_bandwidth}, ' if with_cp else ''}host "
        f"{cost.host_bandwidth} B/s; bf16 speedup x{cost.mixed_speedup:g}; profiled at "
        f"{result.profile_batch} sample(s) per microbatch, scaled linearly",
        _where_note(result.device),
    ]
    return "\n".join(lines)


def _ep_bandwidth(result: SearchResult) -> str:
    """The all-to-alls' bandwidth, where expert parallelism was searched."""
    return f"ep {result.cost.ep_bandwidth}, " if max(result.ep_degrees) > 1 else ""


def _usable(result: SearchResult) -> int:
    return int(result.device_memory * (1 - result.headroom))


def _where_note(device: str) -> str:
    if device == "cpu":
        return (
            "memory: one figure per rank (a CPU device: the host is the device, offloaded "
            "state would count in it); plan for GPUs with --device cuda"
        )
    return (
        f"memory: peak GiB = the {device} device's per rank; host GiB = offloaded state in "
        "pinned host memory per rank (cap it with --host-memory)"
    )
