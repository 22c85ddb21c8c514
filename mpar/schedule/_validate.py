"""``validate``: placement, ordering and counts of a schedule's actions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mpar.errors import ScheduleError
from mpar.schedule._ir import COMMUNICATION_KINDS, Action, Kind, Schedule

__all__ = ["validate"]

_Key = tuple[Kind, int, int | None]
# A stage may be gathered and freed more than once per step (mpar.schedule.lower_sharding).
_REPEATABLE = frozenset({Kind.UNSHARD, Kind.RESHARD})


@dataclass(frozen=True)
class _Problem:
    text: str
    rank: int
    step: int | None = None
    """None when the problem has no cell (a missing action): the row is marked."""


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is well formed.

    Checks, in this order: every rank is in ``0..p-1``; every action's stage
    and microbatch are in range and the stage sits on its rank (``Schedule.stage_to_rank``); no
    action appears twice; on its rank ``F(s,j)`` comes before ``B(s,j)`` (or
    ``I(s,j)``), ``I`` before ``W``, a send after the compute that produces
    its data and a receive before the compute that consumes it; every
    (stage, microbatch) has exactly one F and, unless the schedule is
    forward-only, exactly one B or one I and one W; and, if the schedule has
    any communication actions, every cross-rank edge has its send and its
    receive, and each stage's receives come in the order the neighbouring
    stage sends (one stream per pair of stages and direction). The message
    shows the rank x step grid with the failing cell in brackets (or the
    failing rank's row marked ``<--``).
    """
    problem = next(_problems(schedule), None)
    if problem is None:
        return
    if problem.step is None:
        grid = schedule.format_grid(mark_rank=problem.rank, note=problem.text)
    else:
        grid = schedule.format_grid(mark=(problem.rank, problem.step), note=problem.text)
    raise ScheduleError(f"invalid schedule: {problem.text}\n{grid}")


def _problems(schedule: Schedule) -> Iterator[_Problem]:
    yield from _placement_problems(schedule)
    seen: dict[_Key, tuple[int, int]] = {}
    yield from _order_problems(schedule, seen)
    yield from _count_problems(schedule, seen)
    if any(a.kind in COMMUNICATION_KINDS for a in schedule.iter_actions()):
        yield from _edge_problems(schedule, seen)


def _placement_problems(schedule: Schedule) -> Iterator[_Problem]:
    p, m = schedule.num_ranks, schedule.num_microbatches
    for rank in sorted(schedule.actions):
        if not 0 <= rank < p:
            yield _Problem(f"rank {rank} does not exist (ranks are 0..{p - 1})", rank)
            continue
        for step, action in enumerate(schedule.actions[rank]):
            if action.stage >= schedule.num_stages:
                text = f"{action}: stage out of range 0..{schedule.num_stages - 1}"
                yield _Problem(text, rank, step)
            elif action.microbatch is not None and action.microbatch >= m:
                yield _Problem(f"{action}: microbatch out of range 0..{m - 1}", rank, step)
            elif schedule.stage_to_rank(action.stage) != rank:
                home = schedule.stage_to_rank(action.stage)
                text = f"{action}: stage {action.stage} belongs on rank {home}, not {rank}"
                yield _Problem(text, rank, step)


def _order_problems(schedule: Schedule, seen: dict[_Key, tuple[int, int]]) -> Iterator[_Problem]:
    """Duplicates and actions that run before the action they need (same rank)."""
    lowered = any(a.kind in COMMUNICATION_KINDS for a in schedule.iter_actions())
    present = {(a.kind, a.stage, a.microbatch) for a in schedule.iter_actions()}
    for rank in sorted(schedule.actions):
        for step, action in enumerate(schedule.actions[rank]):
            key = (action.kind, action.stage, action.microbatch)
            if key in seen and action.kind not in _REPEATABLE:
                first = seen[key]
                text = f"{action} appears twice (first at rank {first[0]} step {first[1]})"
                yield _Problem(text, rank, step)
                continue
            for needed in _local_prerequisites(schedule, action, lowered):
                # an action missing altogether is reported by the count check
                if not any(k in seen for k in needed) and any(k in present for k in needed):
                    names = " or ".join(str(Action(k[1], k[0], k[2])) for k in needed)
                    yield _Problem(f"{action} runs before {names}", rank, step)
                    break
            seen[key] = (rank, step)


def _local_prerequisites(schedule: Schedule, action: Action, lowered: bool) -> list[list[_Key]]:
    """Alternatives that must precede ``action`` on its own rank."""
    s, j, kind = action.stage, action.microbatch, action.kind
    last, home = schedule.num_stages - 1, schedule.stage_to_rank
    needs: list[list[_Key]] = []
    if kind in (Kind.B, Kind.I):
        needs.append([(Kind.F, s, j)])
        if lowered and s < last and home(s + 1) != home(s):
            needs.append([(Kind.RECV_B, s, j)])
    elif kind == Kind.F and lowered and s > 0 and home(s - 1) != home(s):
        needs.append([(Kind.RECV_F, s, j)])
    elif kind == Kind.W:
        needs.append([(Kind.I, s, j)])
    elif kind == Kind.SEND_F:
        needs.append([(Kind.F, s, j)])
    elif kind == Kind.SEND_B:
        needs.append([(Kind.B, s, j), (Kind.I, s, j)])
    return needs


def _count_problems(schedule: Schedule, seen: dict[_Key, tuple[int, int]]) -> Iterator[_Problem]:
    training = not schedule.is_forward_only
    for s in range(schedule.num_stages):
        rank = schedule.stage_to_rank(s)
        for j in range(schedule.num_microbatches):
            has = {kind for kind in (Kind.F, Kind.B, Kind.I, Kind.W) if (kind, s, j) in seen}
            missing = _missing(has, training)
            if missing:
                text = f"stage {s} microbatch {j} has no {missing} (expected exactly one)"
                yield _Problem(text, rank)
            elif Kind.B in has and Kind.I in has:
                where = seen[(Kind.I, s, j)]
                text = f"stage {s} microbatch {j} has both B and I/W; use one or the other"
                yield _Problem(text, where[0], where[1])


def _missing(has: set[Kind], training: bool) -> str:
    if Kind.F not in has:
        return "F"
    if not training or Kind.B in has:
        return ""
    if Kind.I not in has:
        return "B (or I and W)"
    return "" if Kind.W in has else "W"


def _edge_problems(schedule: Schedule, seen: dict[_Key, tuple[int, int]]) -> Iterator[_Problem]:
    """In a lowered schedule, every cross-rank edge has one send and one receive."""
    last = schedule.num_stages - 1
    home = schedule.stage_to_rank
    backward = not schedule.is_forward_only
    for (kind, s, j), (rank, step) in seen.items():
        target = {Kind.SEND_F: s + 1, Kind.RECV_F: s - 1, Kind.SEND_B: s - 1, Kind.RECV_B: s + 1}
        if kind in target and not (0 <= target[kind] <= last and home(target[kind]) != home(s)):
            yield _Problem(f"{Action(s, kind, j)} has no peer on another rank", rank, step)
    for s in range(last):
        if home(s) == home(s + 1):
            continue
        for j in range(schedule.num_microbatches):
            pairs = [(Kind.SEND_F, s), (Kind.RECV_F, s + 1)]
            if backward:
                pairs += [(Kind.SEND_B, s + 1), (Kind.RECV_B, s)]
            for kind, stage in pairs:
                if (kind, stage, j) not in seen:
                    text = f"lowered schedule lacks {Action(stage, kind, j)}"
                    yield _Problem(text, home(stage))
    yield from _fifo_problems(schedule)


def _fifo_problems(schedule: Schedule) -> Iterator[_Problem]:
    """Transfers from one stage to the next (or back) travel on one stream, in order:
    the receiving rank must take them in the order the sending rank sends them."""
    order: dict[tuple[Kind, int], list[tuple[int, int, int | None]]] = {}
    for rank in sorted(schedule.actions):
        for step, action in enumerate(schedule.actions[rank]):
            if action.kind in COMMUNICATION_KINDS:
                key = (action.kind, action.stage)
                order.setdefault(key, []).append((rank, step, action.microbatch))
    receiver = {Kind.SEND_F: (Kind.RECV_F, 1), Kind.SEND_B: (Kind.RECV_B, -1)}
    for (kind, s), sent in order.items():
        if kind not in receiver:
            continue
        recv, offset = receiver[kind]
        received = order.get((recv, s + offset), [])
        for (_, _, j_sent), (rank, step, j_received) in zip(sent, received):
            if j_sent != j_received:
                text = (
                    f"{Action(s + offset, recv, j_received)} comes before "
                    f"{Action(s + offset, recv, j_sent)}, but stage {s} sends microbatch "
                    f"{j_sent} first: transfers between two stages arrive in the order "
                    "they are sent"
                )
                yield _Problem(text, rank, step)
                break
