"""``simulate``: run every rank's action list with unit or profiled costs.

The model is the runtime's: each rank executes its actions strictly in list
order; sends are non-blocking (they cost the sender nothing) and receives are
blocking (a rank waits at an action until its input has arrived). An action
therefore starts at ``max(rank free, inputs arrived)``, and a state where no
unfinished rank can start its next action is a deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mpar.errors import ScheduleError
from mpar.schedule._ir import Action, Kind, Schedule
from mpar.schedule._validate import validate

__all__ = ["SimulationResult", "StageCosts", "TimedAction", "peak_in_flight", "simulate"]


@dataclass(frozen=True)
class StageCosts:
    """Per-stage durations (any time unit, e.g. milliseconds from a profile).

    ``input_backward``/``weight_backward`` (I and W of split backward)
    default to half of ``backward``. ``comm`` is the latency of one transfer
    between ranks (none between stages on the same rank). Communication and
    UNSHARD/RESHARD/REDUCE_GRAD actions take no time on the rank itself.
    """

    forward: Sequence[float]
    backward: Sequence[float]
    comm: float = 0.0
    input_backward: Sequence[float] | None = None
    weight_backward: Sequence[float] | None = None

    def __post_init__(self) -> None:
        forward = _durations("forward", self.forward)
        backward = _durations("backward", self.backward)
        half = tuple(b / 2 for b in backward)
        ib = (
            half
            if self.input_backward is None
            else _durations("input_backward", self.input_backward)
        )
        wb = (
            half
            if self.weight_backward is None
            else _durations("weight_backward", self.weight_backward)
        )
        if not len(forward) == len(backward) == len(ib) == len(wb):
            raise ScheduleError(
                f"StageCosts lists differ in length (forward: {len(forward)}, backward: "
                f"{len(backward)}, input_backward: {len(ib)}, weight_backward: {len(wb)})"
            )
        if not (math.isfinite(self.comm) and self.comm >= 0):
            raise ScheduleError(f"StageCosts.comm must be finite and >= 0, got {self.comm!r}")
        object.__setattr__(self, "forward", forward)
        object.__setattr__(self, "backward", backward)
        object.__setattr__(self, "input_backward", ib)
        object.__setattr__(self, "weight_backward", wb)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        forward: float = 1.0,
        backward: float = 2.0,
        input_backward: float = 1.0,
        weight_backward: float = 1.0,
        comm: float = 0.0,
    ) -> StageCosts:
        """The same costs for every stage; the defaults are the unit costs."""
        return cls(
            [forward] * num_stages,
            [backward] * num_stages,
            comm,
            [input_backward] * num_stages,
            [weight_backward] * num_stages,
        )

    def duration(self, action: Action) -> float:
        """How long ``action`` keeps its rank busy."""
        kind = action.kind
        if kind == Kind.F:
            return float(self.forward[action.stage])
        if kind == Kind.B:
            return float(self.backward[action.stage])
        if kind == Kind.I and self.input_backward is not None:
            return float(self.input_backward[action.stage])
        if kind == Kind.W and self.weight_backward is not None:
            return float(self.weight_backward[action.stage])
        return 0.0


def _durations(name: str, values: Sequence[float]) -> tuple[float, ...]:
    result = tuple(float(value) for value in values)
    bad = [value for value in result if not (math.isfinite(value) and value >= 0)]
    if bad:
        raise ScheduleError(f"StageCosts.{name} must be finite and >= 0, got {bad[0]!r}")
    return result


@dataclass(frozen=True)
class TimedAction:
    """One action as it ran in a simulation."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """Timeline and summary figures of one simulated schedule step.

    ``bubble_fraction = 1 - sum(busy) / (num_ranks * makespan)``: the share
    of rank-time spent idle within the step. ``peak_in_flight[r]`` is defined
    by ``peak_in_flight(schedule)``.
    """

    schedule: Schedule
    costs: StageCosts
    timeline: dict[int, list[TimedAction]]
    """Per rank, its actions with start and end times, in list order."""
    makespan: float
    """Time from the first action's start (0) to the last action's end."""
    busy: tuple[float, ...]
    """Per rank, the sum of its actions' durations."""
    peak_in_flight: tuple[int, ...]
    idle: tuple[float, ...] = field(init=False)
    """Per rank, ``makespan - busy``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "idle", tuple(self.makespan - b for b in self.busy))

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum(busy) / (num_ranks * makespan)`` (0 for an empty step)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def to_dict(self) -> dict[str, object]:
        """Summary figures as a JSON-ready dict."""
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "busy": list(self.busy),
            "idle": list(self.idle),
            "peak_in_flight": list(self.peak_in_flight),
        }


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs in flight at once.

    A pair is in flight on a rank from the end of its forward until the end
    of its backward there (B, or W when the backward is split into I and W).
    A rank runs one action at a time, so this is the maximum over prefixes of
    the rank's action list of (forwards done - backwards done), counting only
    forwards that have a backward in the schedule: a forward-only schedule has
    nothing in flight.
    """
    ends = {Kind.B, Kind.W}
    with_backward = {(a.stage, a.microbatch) for a in schedule.iter_actions() if a.kind in ends}
    peaks = []
    for rank in range(schedule.num_ranks):
        current = peak = 0
        for action in schedule.actions.get(rank, []):
            pair = (action.stage, action.microbatch)
            if action.kind == Kind.F and pair in with_backward:
                current += 1
                peak = max(peak, current)
            elif action.kind in ends:
                current -= 1
        peaks.append(peak)
    return peaks


def simulate(schedule: Schedule, costs: StageCosts | None = None) -> SimulationResult:
    """Run ``schedule`` with ``costs`` (default: F=1, B=2, I=1, W=1, no comm).

    Dependencies: ``F(s,j)`` needs ``F(s-1,j)``; ``B(s,j)`` (or ``I(s,j)``)
    needs ``F(s,j)`` and ``B(s+1,j)`` (or ``I(s+1,j)``); ``W(s,j)`` needs
    ``I(s,j)``; data crossing ranks arrives ``costs.comm`` later. In a lowered
    schedule (``lower_communication``) the cross-rank inputs come through its
    RECV actions, which wait for the matching SEND. Raises ``ScheduleError``
    if the schedule is invalid (``validate``) or deadlocks, naming which rank
    waits at which action for what.
    """
    validate(schedule)
    if costs is None:
        costs = StageCosts.uniform(schedule.num_stages)
    if len(costs.forward) != schedule.num_stages:
        raise ScheduleError(
            f"costs cover {len(costs.forward)} stages but the schedule has {schedule.num_stages}"
        )
    state = _State(schedule, costs)
    state.run()
    busy = tuple(sum(t.end - t.start for t in state.timeline[r]) for r in range(schedule.num_ranks))
    makespan = max(state.clock, default=0.0)
    return SimulationResult(
        schedule, costs, state.timeline, makespan, busy, tuple(peak_in_flight(schedule))
    )


class _State:
    """Clocks, cursors and finish times of a simulation in progress."""

    def __init__(self, schedule: Schedule, costs: StageCosts) -> None:
        self.schedule = schedule
        self.costs = costs
        self.ranks = range(schedule.num_ranks)
        self.lists = [schedule.actions.get(r, []) for r in self.ranks]
        self.position = {a: (r, i) for r in self.ranks for i, a in enumerate(self.lists[r])}
        self.finish: dict[Action, float] = {}
        self.clock = [0.0 for _ in self.ranks]
        self.cursor = [0 for _ in self.ranks]
        self.timeline: dict[int, list[TimedAction]] = {r: [] for r in self.ranks}

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for rank in self.ranks:
                progressed = self._advance(rank) or progressed
        if any(self.cursor[r] < len(self.lists[r]) for r in self.ranks):
            raise ScheduleError(self._deadlock_message())

    def _advance(self, rank: int) -> bool:
        """Run ``rank``'s actions until one must wait; True if any ran."""
        actions, start_cursor = self.lists[rank], self.cursor[rank]
        while self.cursor[rank] < len(actions):
            action = actions[self.cursor[rank]]
            ready = self.clock[rank]
            for needed, latency in self.inputs(action):
                done = self.finish.get(needed)
                if done is None:
                    return self.cursor[rank] > start_cursor
                ready = max(ready, done + latency)
            end = ready + self.costs.duration(action)
            self.finish[action] = end
            self.clock[rank] = end
            self.timeline[rank].append(TimedAction(rank, action, ready, end))
            self.cursor[rank] += 1
        return self.cursor[rank] > start_cursor

    def inputs(self, action: Action) -> list[tuple[Action, float]]:
        """The actions whose results ``action`` waits for, with their latency."""
        s, j, kind = action.stage, action.microbatch, action.kind
        comm = self.costs.comm if self.schedule.num_ranks > 1 else 0.0
        if kind == Kind.F:
            return (
                [] if s == 0 else [self._via(Action(s, Kind.RECV_F, j), Action(s - 1, Kind.F, j))]
            )
        if kind in (Kind.B, Kind.I):
            needs = [(Action(s, Kind.F, j), 0.0)]
            if s < self.schedule.num_stages - 1:
                needs.append(self._via(Action(s, Kind.RECV_B, j), self._gradient(s + 1, j)))
            return needs
        if kind == Kind.W:
            return [(Action(s, Kind.I, j), 0.0)]
        if kind == Kind.SEND_F:
            return [(Action(s, Kind.F, j), 0.0)]
        if kind == Kind.SEND_B:
            return [(self._gradient(s, j), 0.0)]
        if kind == Kind.RECV_F:
            return [(Action(s - 1, Kind.SEND_F, j), comm)]
        if kind == Kind.RECV_B:
            return [(Action(s + 1, Kind.SEND_B, j), comm)]
        return []

    def _via(self, receive: Action, producer: Action) -> tuple[Action, float]:
        """Wait on ``receive`` if the schedule has it, else directly on ``producer``."""
        if receive in self.position:
            return receive, 0.0
        home = self.schedule.stage_to_rank
        crosses = home(receive.stage) != home(producer.stage)
        return producer, self.costs.comm if crosses else 0.0

    def _gradient(self, s: int, j: int | None) -> Action:
        """The action producing stage ``s``'s input gradient: B, or I if split."""
        full = Action(s, Kind.B, j)
        return full if full in self.position else Action(s, Kind.I, j)

    def _deadlock_message(self) -> str:
        lines = ["schedule deadlocks: no rank can start its next action"]
        first = None
        for rank in self.ranks:
            step = self.cursor[rank]
            if step >= len(self.lists[rank]):
                continue
            action = self.lists[rank][step]
            first = first or (rank, step)
            missing = [a for a, _ in self.inputs(action) if a not in self.finish]
            lines.append(
                f"  rank {rank} waits at step {step} ({action}) for {self._describe(missing)}"
            )
        grid = self.schedule.format_grid(mark=first, note="waits here")
        return "\n".join([*lines, grid])

    def _describe(self, missing: list[Action]) -> str:
        parts = []
        for action in missing:
            where = self.position.get(action)
            if where is None:
                parts.append(f"{action}, which is not in the schedule")
            else:
                parts.append(f"{action} (rank {where[0]} step {where[1]})")
        return " and ".join(parts)
