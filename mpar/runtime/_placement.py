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

The placement is then checked against what it replaced, the way the project measures
speed: when it differs from ZB-H1's order, the sixth step warms it up, and steps 7 to 12
alternate the two orders (ZB-H1's at 7, 9 and 11, the placed one at 8, 10 and 12), each
timed as long as its longest rank's part. Unless the median of the three pairs' ratios
says the placed order ran at least 1 % faster, every rank goes back to ZB-H1's order
from the thirteenth step on. A simulation from the shortest measured times can favour
an order that the machine runs slower: on issue 29's benchmark at ``m=8``, with an
allowance of 4, an order simulated 4 % faster ran 1.0-1.5 % slower in these pairs.
"""

from __future__ import annotations

import statistics
import sys
from typing import TypedDict

from mpar.comm import State
from mpar.comm._collectives import all_gather_object_world
from mpar.runtime._timeline import StepTimeline
from mpar.schedule import Action, Kind, Schedule, StageCosts

__all__ = ["MeasuredPlacement"]

_MEASURED_STEPS = (3, 4, 5)
"""The training steps whose action times are measured: the first partitions and traces,
and the next one or two still run slower than the rest (allocator, caches)."""
_PAIRS = ((7, 8), (9, 10), (11, 12))
"""Checked steps, paired: (ZB-H1's order, the placed order). The sixth step, the placed
order's first, warms it up."""
_CHECKED_STEPS = tuple(step for pair in _PAIRS for step in pair)
_UNIT_STEPS = frozenset(unit for unit, _ in _PAIRS)
_GAIN = 0.01
"""How much faster than ZB-H1's order the placed order must run to be kept."""
_KINDS = (Kind.F, Kind.I, Kind.W)


class MeasuredPlacement:
    """Decides when to time a step and builds the placed schedule from its timeline."""

    def __init__(self) -> None:
        self.training_steps = 0
        self.samples: list[_RankTimes] = []
        """This rank's action times from the measured steps so far."""
        self.costs: StageCosts | None = None
        """The gathered times (seconds) the placement was made from, once it is."""
        self.ratios: list[float] = []
        """Placed over ZB-H1's step time, for each checked pair (when they differ)."""
        self.kept: bool | None = None
        """Whether the placed order was kept (None: not checked, or the same as ZB-H1's)."""
        self._spans: list[float] = []
        self._orders: tuple[Schedule, Schedule] | None = None
        """While checking: (ZB-H1's order, the placed one), not lowered."""

    def records(self, st: State, training: bool) -> bool:
        """Whether the step about to run (with ``st``'s config) is one to time."""
        step = self.training_steps + 1
        checking = self._orders is not None and step in _CHECKED_STEPS
        return training and (step in _MEASURED_STEPS or checking) and _wanted(st)

    def after_step(
        self, st: State, training: bool, timeline: StepTimeline | None
    ) -> Schedule | None:
        """Count the step; the schedule the next step runs when it changes (not yet
        lowered): the placed one after the last measured step, then, while checking, the
        two orders in turn, and after the last checked step the one that ran faster."""
        if not training:
            return None
        self.training_steps += 1
        step = self.training_steps
        if timeline is None or not _wanted(st):
            return None
        if step in _MEASURED_STEPS:
            self.samples.append(_local_times(timeline))
            if step != _MEASURED_STEPS[-1]:
                return None
            every = all_gather_object_world(self.samples, st.grid)
            self.costs = _costs([rank for steps in every for rank in steps], st.config.num_stages)
            placed, unit = _placed(st, self.costs), _placed(st, None)
            if placed.actions != unit.actions:
                self._orders = (unit, placed)
            return placed
        if self._orders is None or not _MEASURED_STEPS[-1] < step <= _CHECKED_STEPS[-1]:
            return None
        unit, placed = self._orders
        if step in _CHECKED_STEPS:
            self._spans.append(_span(timeline))
        if step != _CHECKED_STEPS[-1]:
            return unit if step + 1 in _UNIT_STEPS else placed
        by_rank = all_gather_object_world(self._spans, st.grid)
        self._orders = None
        longest = [max(spans[k] for spans in by_rank) for k in range(len(_CHECKED_STEPS))]
        self.ratios = [longest[k + 1] / longest[k] for k in range(0, len(longest), 2)]
        ratio = statistics.median(self.ratios)
        self.kept = ratio <= 1 - _GAIN
        if st.layout.rank == 0:
            print(
                f"mpar: zero_bubble placed from measured times ran at {ratio:.3f}x the step "
                f"time of ZB-H1's order (median of {len(self.ratios)} alternating pairs); "
                + ("kept" if self.kept else "back to ZB-H1's order"),
                file=sys.stderr,
            )
        return placed if self.kept else unit


def _span(timeline: StepTimeline) -> float:
    """This rank's part of a step: its first action's start to its last action's end."""
    actions = timeline.actions
    return actions[-1][2] - actions[0][1] if actions else 0.0


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


class _RankTimes(TypedDict):
    """One rank's action times of one measured step, in seconds."""

    times: dict[tuple[int, str], list[float]]
    """(stage, kind) -> each such action's busy time."""
    sends: list[float]


def _local_times(timeline: StepTimeline) -> _RankTimes:
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


def _costs(every: list[_RankTimes], num_stages: int) -> StageCosts:
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


def _placed(st: State, costs: StageCosts | None) -> Schedule:
    """The placement from ``costs`` (None: ZB-H1's order, from unit costs)."""
    from mpar.schedule import zero_bubble

    cfg = st.config
    return zero_bubble(
        cfg.num_stages,
        cfg.pipeline_parallel_degree,
        cfg.microbatches,
        active_microbatches=cfg.active_microbatches,
        costs=costs,
    )
