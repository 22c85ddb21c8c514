"""Zero-bubble pipelining (Qi et al., 2024): the backward split into I and W.

``I(s, j)`` computes the gradient of stage ``s``'s input for microbatch ``j``
(what the previous stage waits for); ``W(s, j)`` computes the stage's weight
gradients from what ``I`` kept, and nobody waits for it. So a rank can run
``I`` as soon as the gradient arrives and defer ``W`` into the idle slots that
1F1B leaves in its cool-down and warm-up.

:func:`zero_bubble` keeps the forward and input-backward order of 1F1B
(``interleaved``, Megatron's order with ``v > 1``) and places each ``W`` by a
unit-cost simulation (F = I = W = 1): a rank runs its next F or I when the
input is there, otherwise its oldest deferred W, otherwise idles. A W is also
forced before a forward that would hold more microbatches than 1F1B holds at
its peak on that rank (a microbatch's activations are freed by its W), so the
activation memory is 1F1B's: this is ZB-H1 for ``v == 1``. Rank x time with
unit costs, ``p=3, m=6`` (compare ``interleaved``: 24 steps, bubble 25%)::

    time   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20
    rank 0 0F0 0F1 0F2 .   .   0I0 0W0 0F3 0I1 0W1 0F4 0I2 0W2 0F5 0I3 0W3 0I4 0W4 0I5 0W5 .
    rank 1 .   1F0 1F1 .   1I0 1W0 1F2 1I1 1W1 1F3 1I2 1W2 1F4 1I3 1W3 1F5 1I4 0W4 1I5 1W5 .

(the exact grid: ``mpar schedule --pipeline zero_bubble --stages 3 --microbatches 6``).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

from mpar.errors import ScheduleError
from mpar.schedule._generators import (
    _check_positive,
    _check_shape,
    check_interleaved,
    interleaved,
)
from mpar.schedule._ir import Action, Kind, Schedule
from mpar.schedule._simulate import StageCosts, peak_in_flight, simulate

__all__ = ["zbv", "zero_bubble", "zero_bubble_allowance", "zero_bubble_peak"]


def zero_bubble(
    num_stages: int,
    num_ranks: int,
    num_microbatches: int,
    *,
    active_microbatches: int | None = None,
    forward_only: bool = False,
    costs: StageCosts | None = None,
) -> Schedule:
    """ZB-H1 (``v == 1``) or its interleaved variant (``v > 1``): 1F1B's order with B
    split into I and W, each W deferred into a bubble, at 1F1B's activation memory.

    Takes the same arguments, and has the same requirements, as ``interleaved``
    (``active_microbatches`` caps the warm-up the same way).
    ``forward_only=True`` gives the forward actions only, as ``interleaved`` does.

    ``costs`` (the stages' real F, I and W times, e.g. measured) places W by a timed
    simulation instead of unit costs: a rank waiting for its next F or I runs a deferred
    W only when the wait is long enough for it. Several placements are built and the one
    whose three consecutive steps simulate shortest with ``costs`` is kept (the
    unit-cost one among them, so it is never more than 1% slower under ``costs``;
    among placements within 1% of the fastest, the one holding the fewest
    microbatches). There, ``active_microbatches=k`` above 1F1B's peak is an
    allowance: a placement may hold up to ``k`` microbatches on every rank or on one
    rank, and is kept only if that shortens the steps. With stages of unequal cost
    this finds orders the unit costs cannot. With ``p=2, m=4`` and a heavier last stage
    (issue 29's benchmark, its traced times), ``k=3`` gives rank 1 a third microbatch.
    That order ran 1.07x the unit-cost one (``benchmarks/README.md``).
    """
    p, v, m = _check_shape(num_stages, num_ranks, num_microbatches)
    check_interleaved(p, v, m, active_microbatches, forward_only, "zero_bubble")
    base = interleaved(
        num_stages,
        num_ranks,
        num_microbatches,
        active_microbatches=active_microbatches,
        forward_only=forward_only,
    )
    if forward_only:
        return Schedule(num_stages, num_ranks, num_microbatches, base.actions, name="zero_bubble")
    # the busiest rank's 1F1B memory, on every rank (zero_bubble_peak, or the cap below it)
    limit = max(peak_in_flight(base))
    unit = Schedule(
        num_stages, num_ranks, num_microbatches, _unit_placement(base, limit), name="zero_bubble"
    )
    if costs is None:
        return unit
    if len(costs.forward) != num_stages:
        raise ScheduleError(
            f"costs cover {len(costs.forward)} stages, the schedule has {num_stages}"
        )
    limits = [(limit,) * num_ranks]  # per rank
    k = zero_bubble_allowance(
        num_ranks, num_microbatches, num_stages // num_ranks, active_microbatches
    )
    if k is not None:  # the allowance on every rank, or on one rank
        limits.append((k,) * num_ranks)
        limits += [
            tuple(k if q == r else limit for q in range(num_ranks)) for r in range(num_ranks)
        ]
    candidates = [unit]
    for most in limits:
        for fit in _FITS:
            actions = _timed_placement(base, most, costs, fit)
            candidates.append(
                Schedule(num_stages, num_ranks, num_microbatches, actions, name="zero_bubble")
            )
    timed = []
    for i, candidate in enumerate(candidates):
        held = peak_in_flight(candidate)
        timed.append((_steps_makespan(candidate, costs), (max(held), sum(held)), i))
    fastest = min(t for t, _, _ in timed)
    near = [(memory, t, i) for t, memory, i in timed if t <= fastest * (1 + _NEAR)]
    return candidates[min(near)[2]]  # the least memory among the near-fastest


@functools.lru_cache(maxsize=256)
def zero_bubble_peak(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """The most microbatches :func:`zero_bubble` holds on a rank without a cap: 1F1B's
    peak on its busiest rank (``p`` for ``v == 1``, at most the microbatches)."""
    base = interleaved(num_ranks * virtual_stages, num_ranks, num_microbatches)
    return max(peak_in_flight(base))


def zero_bubble_allowance(
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    active_microbatches: int | None = None,
) -> int | None:
    """``active_microbatches`` when :func:`zero_bubble` reads it as an allowance (above
    :func:`zero_bubble_peak`: a placement from measured times may hold that many on a
    rank), else None (no value, or a cap at or below the peak)."""
    k = active_microbatches
    if k is None or k <= zero_bubble_peak(num_ranks, num_microbatches, virtual_stages):
        return None
    return k


_FITS = (0.25, 0.5, 0.75, 1.0)
"""How long a wait must be, in W's duration, for a rank to fill it with a deferred W."""
_NEAR = 0.01
"""Placements within this share of the fastest count as equal; the one holding the fewest
microbatches is kept."""
_STEPS = 3
"""Consecutive steps a candidate is simulated over: the next step's first forwards wait
for the last backwards of this one, which a single step does not show."""


def _unit_placement(base: Schedule, limit: int) -> dict[int, list[Action]]:
    ranks = [_Rank(r, [_split(a) for a in base.actions[r]], limit) for r in range(base.num_ranks)]
    finished: dict[Action, int] = {}
    t = 0
    while not all(rank.done for rank in ranks):
        started = [(rank, rank.choose(finished, t, base.num_stages)) for rank in ranks]
        for rank, action in started:
            if action is not None:
                rank.out.append(action)
                finished[action] = t + 1
        t += 1
    return {rank.r: rank.out for rank in ranks}


def _timed_placement(
    base: Schedule, limit: tuple[int, ...], costs: StageCosts, fit: float
) -> dict[int, list[Action]]:
    """W placed by a simulation with ``costs``: each rank, when free, starts its next F
    or I if its input is there; otherwise a deferred W if the wait is at least ``fit``
    W-durations long (or not known yet); otherwise it waits. A W is forced before a
    forward that would hold more than ``limit[rank]`` microbatches."""
    p, n = base.num_ranks, base.num_stages
    orders = [[_split(a) for a in base.actions[r]] for r in range(p)]
    upcoming, held = [0] * p, [0] * p
    deferred: list[deque[Action]] = [deque() for _ in range(p)]
    clock = [0.0] * p
    finish: dict[Action, float] = {}
    out: dict[int, list[Action]] = {r: [] for r in range(p)}

    def arrival(action: Action) -> float | None:
        needed = _input_of(action, n)
        if needed is None:
            return 0.0
        if needed not in finish:
            return None  # its producer has not been placed yet
        crosses = base.stage_to_rank(needed.stage) != base.stage_to_rank(action.stage)
        return finish[needed] + (costs.comm if crosses else 0.0)

    while any(upcoming[r] < len(orders[r]) or deferred[r] for r in range(p)):
        best: tuple[float, int, bool] | None = None  # (start, rank, runs a W)
        for r in range(p):
            nxt = orders[r][upcoming[r]] if upcoming[r] < len(orders[r]) else None
            if nxt is None and not deferred[r]:
                continue
            at = None if nxt is None else arrival(nxt)
            if nxt is not None and nxt.kind == Kind.F and held[r] >= limit[r] and deferred[r]:
                choice = (clock[r], r, True)
            elif at is not None and at <= clock[r]:
                choice = (clock[r], r, False)
            elif deferred[r] and (
                at is None or at - clock[r] >= fit * costs.duration(deferred[r][0])
            ):
                choice = (clock[r], r, True)
            elif at is not None:
                choice = (at, r, False)
            else:
                continue  # waits for an input not placed yet
            if best is None or choice < best:
                best = choice
        if best is None:  # every rank waits on another: cannot happen for a valid order
            raise ScheduleError("internal: zero_bubble's timed placement found no action to run")
        start, r, weight = best
        if weight:
            action = deferred[r].popleft()
            held[r] -= 1
        else:
            action = orders[r][upcoming[r]]
            upcoming[r] += 1
            if action.kind == Kind.F:
                held[r] += 1
            else:
                deferred[r].append(Action(action.stage, Kind.W, action.microbatch))
        clock[r] = max(clock[r], start) + costs.duration(action)
        finish[action] = clock[r]
        out[r].append(action)
    return out


def _input_of(action: Action, num_stages: int) -> Action | None:
    """The action whose result ``action`` (an F or an I) needs from another stage, or
    from its own forward on the last stage."""
    s, j = action.stage, action.microbatch
    if action.kind == Kind.F:
        return None if s == 0 else Action(s - 1, Kind.F, j)
    return Action(s, Kind.F, j) if s == num_stages - 1 else Action(s + 1, Kind.I, j)


def _steps_makespan(schedule: Schedule, costs: StageCosts) -> float:
    """Simulated time of ``_STEPS`` steps of ``schedule`` run back to back (each step's
    microbatches numbered after the previous step's)."""
    m = schedule.num_microbatches
    actions = {
        r: [
            Action(a.stage, a.kind, None if a.microbatch is None else a.microbatch + k * m)
            for k in range(_STEPS)
            for a in schedule.actions[r]
        ]
        for r in range(schedule.num_ranks)
    }
    steps = Schedule(schedule.num_stages, schedule.num_ranks, _STEPS * m, actions)
    return simulate(steps, costs).makespan


def _split(action: Action) -> Action:
    return Action(action.stage, Kind.I, action.microbatch) if action.kind == Kind.B else action


@dataclass
class _Rank:
    """One rank during the placement simulation."""

    r: int
    order: list[Action]
    """F and I actions in 1F1B order."""
    limit: int
    """Most microbatches (stage, microbatch pairs) whose W has not run yet."""
    out: list[Action] = field(default_factory=list)
    next: int = 0
    held: int = 0
    deferred: deque[Action] = field(default_factory=deque)

    @property
    def done(self) -> bool:
        return self.next == len(self.order) and not self.deferred

    def choose(self, finished: dict[Action, int], t: int, num_stages: int) -> Action | None:
        """The action this rank starts at time ``t`` (None: idle)."""
        upcoming = self.order[self.next] if self.next < len(self.order) else None
        if upcoming is not None and upcoming.kind == Kind.F and self.held >= self.limit:
            return self._weight()  # a forward now would exceed 1F1B's memory
        if upcoming is not None and _ready(upcoming, finished, t, num_stages):
            self.next += 1
            if upcoming.kind == Kind.F:
                self.held += 1
            else:
                self.deferred.append(Action(upcoming.stage, Kind.W, upcoming.microbatch))
            return upcoming
        return self._weight() if self.deferred else None

    def _weight(self) -> Action:
        self.held -= 1
        return self.deferred.popleft()


def _ready(action: Action, finished: dict[Action, int], t: int, num_stages: int) -> bool:
    needed = _input_of(action, num_stages)
    return needed is None or finished.get(needed, t + 1) <= t


def zbv(
    num_stages: int,
    num_ranks: int,
    num_microbatches: int,
    *,
    active_microbatches: int | None = None,
    forward_only: bool = False,
) -> Schedule:
    """ZBV: two chunks per rank in a V (stage ``s < p`` on rank ``s``, ``s >= p`` on
    rank ``2p-1-s``), backward split into I and W, near-zero bubble at 1F1B's memory.

    Built by a unit-cost simulation (F = I = W = 1 per chunk) in which every rank
    starts, at each step, its most useful ready action: an I (the lowest
    microbatch; the later stage first), else an F (its second chunk first, which
    moves microbatches towards the loss), else its oldest deferred W. A rank holds
    at most ``p`` microbatches in its first chunk until their W (``min(p, k)``
    with ``active_microbatches=k``), and so at most ``2p`` chunk-microbatch pairs in
    all: 1F1B's ``p`` microbatches of activations. With the V, the last stage is
    on rank 0, so a microbatch's backward starts where its forward began. Rank x
    step, ``p=2, m=4`` (unit-cost bubble 4%, against 20% for 1F1B)::

        rank 0 0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0F2 0W1 0F3 3F2 ...
        rank 1 1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1 1F2 2F2 1F3 ...
    """
    if num_stages != 2 * num_ranks:
        raise ScheduleError(
            f"zbv places two stages on each rank: it needs {2 * num_ranks} stages for "
            f"{num_ranks} ranks (virtual_stages 2), got {num_stages}"
        )
    cap = num_ranks
    if active_microbatches is not None:
        cap = min(cap, _check_positive("active_microbatches", active_microbatches))
    placement = _VPlacement(num_ranks, num_microbatches, cap, forward_only)
    actions = placement.run()
    return Schedule(num_stages, num_ranks, num_microbatches, actions, name="zbv", placement="v")


class _VPlacement:
    """The unit-cost simulation behind :func:`zbv`."""

    def __init__(self, p: int, m: int, cap: int, forward_only: bool) -> None:
        self.p, self.m, self.cap, self.forward_only = p, m, cap, forward_only
        self.last = 2 * p - 1
        self.finished: dict[Action, int] = {}
        self.next_f = [0] * (2 * p)
        self.next_i = [0] * (2 * p)
        self.held = [0] * p  # first-chunk microbatches whose W has not run
        self.deferred: list[deque[Action]] = [deque() for _ in range(p)]
        self.out: dict[int, list[Action]] = {r: [] for r in range(p)}

    def run(self) -> dict[int, list[Action]]:
        per_rank = 2 * self.m * (1 if self.forward_only else 3)
        t = 0
        while any(len(actions) < per_rank for actions in self.out.values()):
            chosen = [(r, self._choose(r, t)) for r in range(self.p)]
            if all(action is None for _, action in chosen) and t > 4 * per_rank * self.p:
                raise ScheduleError("internal: the zbv placement made no progress")
            for r, action in chosen:
                if action is not None:
                    self.out[r].append(action)
                    self.finished[action] = t + 1
            t += 1
        return self.out

    def _choose(self, r: int, t: int) -> Action | None:
        first, second = r, self.last - r
        if not self.forward_only:
            ready = [
                (self.next_i[s], -s)
                for s in (second, first)
                if self.next_i[s] < self.m
                and _ready(Action(s, Kind.I, self.next_i[s]), self.finished, t, self.last + 1)
            ]
            if ready:
                j, s = min(ready)
                self.next_i[-s] += 1
                self.deferred[r].append(Action(-s, Kind.W, j))
                return Action(-s, Kind.I, j)
        for s in (second, first):
            j = self.next_f[s]
            if j >= self.m or (s == first and not self.forward_only and self.held[r] >= self.cap):
                continue
            if _ready(Action(s, Kind.F, j), self.finished, t, self.last + 1):
                self.next_f[s] += 1
                self.held[r] += s == first
                return Action(s, Kind.F, j)
        if self.deferred[r]:
            weight = self.deferred[r].popleft()
            self.held[r] -= weight.stage == first
            return weight
        return None
