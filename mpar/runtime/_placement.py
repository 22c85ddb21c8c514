"""zero_bubble placed from measured action times (issue 29).

With ``"pipeline": "zero_bubble"`` and ``active_microbatches`` above the microbatches
ZB-H1 holds (1F1B's peak), the runtime times the actions of the third, fourth and fifth
training steps on every rank, gathers them over all ranks, takes each stage's shortest
forward, input-backward and weight-backward time and the shortest send (the least
disturbed by whatever else the machine runs), and from the sixth training step on
runs ``zero_bubble(..., costs=...)``: the W placement whose consecutive steps simulate
shortest with those times, holding up to ``active_microbatches`` where that pays (see
``mpar.schedule.zero_bubble``). Every rank computes the same schedule from the same
gathered times, so the ranks switch together.
"""

from __future__ import annotations

from typing import Any

from mpar.comm import State
from mpar.comm._collectives import all_gather_object_world
from mpar.runtime._timeline import StepTimeline
from mpar.schedule import Action, Kind, Schedule, StageCosts

__all__ = ["MeasuredPlacement"]

_MEASURED_STEPS = (3, 4, 5)
"""The training steps whose action times are measured: the first partitions and traces,
and the next one or two still run slower than the rest (allocator, caches)."""
_KINDS = (Kind.F, Kind.I, Kind.W)


class MeasuredPlacement:
    """Decides when to time a step and builds the placed schedule from its timeline."""

    def __init__(self) -> None:
        self.training_steps = 0
        self.samples: list[dict[str, Any]] = []
        """This rank's action times from the measured steps so far."""
        self.costs: StageCosts | None = None
        """The gathered times (seconds) the placement was made from, once it is."""

    def records(self, st: State, training: bool) -> bool:
        """Whether the step about to run (with ``st``'s config) is one to time."""
        return training and self.training_steps + 1 in _MEASURED_STEPS and _wanted(st)

    def after_step(
        self, st: State, training: bool, timeline: StepTimeline | None
    ) -> Schedule | None:
        """Count the step; after the last timed one, the placed schedule (not yet
        lowered)."""
        if not training:
            return None
        self.training_steps += 1
        if self.training_steps not in _MEASURED_STEPS or timeline is None or not _wanted(st):
            return None
        self.samples.append(_local_times(timeline))
        if self.training_steps != _MEASURED_STEPS[-1]:
            return None
        every = all_gather_object_world(self.samples, st.grid)
        self.costs = _costs([rank for steps in every for rank in steps], st.config.num_stages)
        return _placed(st, self.costs)


def _wanted(st: State) -> bool:
    """Whether this run places W from measured times: ``zero_bubble`` over ranks with
    ``active_microbatches`` as an allowance (``mpar.schedule.zero_bubble_allowance``)."""
    from mpar.schedule import zero_bubble_allowance

    cfg = st.config
    if cfg.pipeline != "zero_bubble" or cfg.pipeline_parallel_degree < 2:
        return False
    allowance = zero_bubble_allowance(
        cfg.pipeline_parallel_degree, cfg.microbatches, cfg.virtual_stages, cfg.active_microbatches
    )
    return allowance is not None


def _local_times(timeline: StepTimeline) -> dict[str, Any]:
    """This rank's action times in seconds: ``{(stage, kind): [...]}`` and its sends."""
    times: dict[tuple[int, str], list[float]] = {}
    sends: list[float] = []
    for text, start, end, waited, _computed in timeline.actions:
        action = Action.parse(text)
        busy = max(0.0, end - start - waited)
        if action.kind in _KINDS:
            times.setdefault((action.stage, action.kind.value), []).append(busy)
        elif action.kind in (Kind.SEND_F, Kind.SEND_B):
            sends.append(busy)
    return {"times": times, "sends": sends}


def _costs(every: list[dict[str, Any]], num_stages: int) -> StageCosts:
    """The shortest time per stage and kind over every rank and measured step that ran
    them (0 where none ran: a W with nothing deferred)."""
    pooled: dict[tuple[int, str], list[float]] = {}
    sends: list[float] = []
    for rank in every:
        for key, values in rank["times"].items():
            pooled.setdefault(key, []).extend(values)
        sends += rank["sends"]

    def shortest(stage: int, kind: Kind) -> float:
        values = pooled.get((stage, kind.value))
        return min(values) if values else 0.0

    forward = [shortest(s, Kind.F) for s in range(num_stages)]
    i_part = [shortest(s, Kind.I) for s in range(num_stages)]
    w_part = [shortest(s, Kind.W) for s in range(num_stages)]
    backward = [i + w for i, w in zip(i_part, w_part)]
    comm = min(sends) if sends else 0.0
    return StageCosts(forward, backward, comm, i_part, w_part)


def _placed(st: State, costs: StageCosts) -> Schedule:
    from mpar.schedule import zero_bubble

    cfg = st.config
    return zero_bubble(
        cfg.num_stages,
        cfg.pipeline_parallel_degree,
        cfg.microbatches,
        active_microbatches=cfg.active_microbatches,
        costs=costs,
    )
