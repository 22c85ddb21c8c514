"""What a plan predicts from the schedule: microbatches in flight, messages held, the
simulated step and bubble (pure).

The schedule is the one the runtime runs (``mpar.schedule.build_schedule`` of the
config keys, ``active_microbatches`` included), built once per shape and cached.
Step time and bubble come from simulating it with the profiled stage times: forward
1/3, backward 2/3 of the measured forward+backward time, each plus half the stage's
``comm`` (``phase_times``); a split backward (I and W actions) is priced with the
``CostModel``'s fractions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mpar import schedule as sched
from mpar.errors import ScheduleError
from mpar.partition._cost import CostModel
from mpar.partition._memory_model import MessageCounts

if TYPE_CHECKING:
    from mpar.partition._plan_inputs import PlanInputs
    from mpar.partition._plan_report import StagePlan

__all__ = [
    "build",
    "in_flight_per_rank",
    "lower_bound_s",
    "message_counts",
    "phase_times",
    "predict",
    "split_backward_gain",
    "splits_backward",
]

SplitCosts = tuple[float, float, float]
"""(I fraction, W fraction, seconds per split action) of a split backward."""
ScheduleKey = tuple[str, int, int, int, "int | None"]
"""(pipeline, pp, virtual stages, microbatches, active_microbatches): what builds a schedule."""


@functools.lru_cache(maxsize=1024)
def build(pipeline: str, p: int, v: int, m: int, active_microbatches: int | None) -> sched.Schedule:
    """The schedule of these config keys, as the runtime builds it (unit costs)."""
    return sched.build_schedule(
        pipeline, p, m, virtual_stages=v, active_microbatches=active_microbatches
    )


def _key(inputs: PlanInputs, pipeline: str | None = None) -> ScheduleKey:
    s = inputs.schedule
    return (
        pipeline or s.pipeline,
        inputs.grid.pp,
        s.virtual_stages,
        s.microbatches,
        s.active_microbatches,
    )


@functools.lru_cache(maxsize=4096)
def in_flight_per_rank(
    p: int, v: int, m: int, pipeline: str, active_microbatches: int | None = None
) -> tuple[int, ...]:
    """Per rank: microbatches in flight per chunk.

    The schedule is the one the runtime runs: ``active_microbatches`` caps it as the
    config key does. ``zero_bubble`` with ``active_microbatches`` above ZB-H1's peak (an
    allowance, ``mpar.schedule.zero_bubble_allowance``) may be placed from measured times
    to hold that many on any rank (``runtime._placement``): counted so."""
    peaks = sched.peak_in_flight(build(pipeline, p, v, m, active_microbatches))
    if pipeline == "zero_bubble":
        allowance = sched.zero_bubble_allowance(p, m, v, active_microbatches)
        peaks = peaks if allowance is None else [allowance] * p
    return tuple(max(1, math.ceil(peak / v)) for peak in peaks)


@functools.lru_cache(maxsize=4096)
def message_counts(
    p: int, v: int, m: int, pipeline: str, active_microbatches: int | None = None
) -> tuple[MessageCounts, ...]:
    """Per stage: the pipeline messages its rank holds at the rank's peak.

    Walks each rank's action list as the runtime executes it: every F of a stage
    whose next stage is on another rank sends an activation message, every B (or I)
    of a stage whose previous stage is on another rank sends a gradient message, and
    the runtime keeps each until the step ends. The count is taken at the last action
    where the rank's microbatches in flight are at their peak (later actions only
    free activations faster than they add messages). Each remote incoming stream has
    one receive posted.
    """
    schedule = build(pipeline, p, v, m, active_microbatches)
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
            if action.kind == sched.Kind.F:
                current += 1
                fwd[s] += remote_next[s]
            elif action.kind in (sched.Kind.B, sched.Kind.I):
                bwd[s] += remote_prev[s]
            if action.kind in (sched.Kind.B, sched.Kind.W):
                current -= 1
            if current >= peak:
                peak = current
                at_peak.update({t: (fwd[t], bwd[t]) for t in range(n) if rank_of[t] == rank})
    return tuple(
        MessageCounts(*at_peak.get(s, (0, 0)), int(remote_prev[s]), int(remote_next[s]))
        for s in range(n)
    )


def phase_times(
    stages: Sequence[StagePlan], checkpointing: bool, cost: CostModel
) -> tuple[list[float], list[float]]:
    """Per stage: forward and backward seconds of one microbatch, comm included."""
    fwd = [s.time_s / 3 + s.comm_s / 2 for s in stages]
    extra = cost.recompute_fraction if checkpointing else 0.0
    bwd = [(2 / 3 + extra) * s.time_s + s.comm_s / 2 for s in stages]
    return fwd, bwd


@functools.lru_cache(maxsize=8192)
def _simulate(
    key: ScheduleKey,
    fwd: tuple[float, ...],
    bwd: tuple[float, ...],
    split: SplitCosts = (0.5, 0.5, 0.0),
) -> tuple[float, float]:
    """(makespan, bubble) of the schedule of ``key``; ``split`` prices I and W where the
    schedule splits the backward (the first stage has no I: its W is its whole backward,
    as the runtime runs it)."""
    i_share, w_share, action = split
    ib = [0.0 if s == 0 else i_share * b for s, b in enumerate(bwd)]
    wb = [b if s == 0 else w_share * b + action for s, b in enumerate(bwd)]
    costs = sched.StageCosts(fwd, bwd, input_backward=ib, weight_backward=wb)
    result = sched.simulate(build(*key), costs)
    return float(result.makespan), float(result.bubble_fraction)


@functools.lru_cache(maxsize=256)
def splits_backward(pipeline: str, p: int, v: int, m: int) -> bool:
    """Whether ``pipeline`` runs split backwards (I and W actions): zero_bubble, zbv, or a
    schedule CSV that has them."""
    schedule = build(pipeline, p, v, m, None)
    kinds = {a.kind for actions in schedule.actions.values() for a in actions}
    return bool(kinds & {sched.Kind.I, sched.Kind.W})


def _split_costs(cost: CostModel) -> SplitCosts:
    return (cost.input_backward_fraction, cost.weight_backward_fraction, cost.split_action_s)


def split_backward_gain(
    stages: Sequence[StagePlan], inputs: PlanInputs, cost: CostModel
) -> float | None:
    """Predicted step of 1F1B (``interleaved``) over that of the schedule on the same
    stages and cap, when the schedule splits the backward; None otherwise (or when 1F1B
    cannot run this shape). Below 1, the split backward costs more than the bubble it
    fills."""
    s, p = inputs.schedule, inputs.grid.pp
    try:
        if not splits_backward(s.pipeline, p, s.virtual_stages, s.microbatches):
            return None
        fwd, bwd = phase_times(stages, inputs.activation_checkpointing, cost)
        mine = _simulate(_key(inputs), tuple(fwd), tuple(bwd), _split_costs(cost))[0]
        plain = _simulate(_key(inputs, "interleaved"), tuple(fwd), tuple(bwd))[0]
    except ScheduleError:
        return None
    return plain / mine if mine > 0 else None


def predict(
    stages: Sequence[StagePlan], inputs: PlanInputs, cost: CostModel
) -> tuple[float, float]:
    """(pipeline makespan, bubble fraction): the schedule simulated on the stages' times."""
    fwd, bwd = phase_times(stages, inputs.activation_checkpointing, cost)
    return _simulate(_key(inputs), tuple(fwd), tuple(bwd), _split_costs(cost))


def lower_bound_s(
    stages: Sequence[StagePlan], p: int, m: int, checkpointing: bool, cost: CostModel
) -> float:
    """A lower bound of the makespan: the busiest rank's work for ``m`` microbatches."""
    fwd, bwd = phase_times(stages, checkpointing, cost)
    return m * max(sum(f + b for f, b in zip(fwd[r::p], bwd[r::p])) for r in range(p))
