"""``lower_communication``: make the point-to-point transfers explicit actions."""

from __future__ import annotations

import dataclasses

from mpar.errors import ScheduleError
from mpar.schedule._ir import COMMUNICATION_KINDS, Action, Kind, Schedule

__all__ = ["lower_communication"]


def lower_communication(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` with SEND_F/RECV_F/SEND_B/RECV_B actions.

    For every edge between stages on different ranks: ``SEND_F(s, j)`` right
    after ``F(s, j)`` and ``RECV_F(s+1, j)`` right before ``F(s+1, j)``;
    ``SEND_B(s, j)`` right after ``B(s, j)`` (or ``I(s, j)``) and
    ``RECV_B(s-1, j)`` right before ``B(s-1, j)`` (or ``I(s-1, j)``). Stages
    on the same rank (``p == 1``) exchange nothing. With the runtime's
    non-blocking sends and blocking receives the lowered schedule runs exactly
    as the compute-only one, so ``simulate`` gives both the same timeline.
    """
    if any(a.kind in COMMUNICATION_KINDS for a in schedule.iter_actions()):
        raise ScheduleError("schedule already has communication actions; lower it only once")
    actions = {
        rank: _lower_rank(schedule, rank_actions) for rank, rank_actions in schedule.actions.items()
    }
    return dataclasses.replace(schedule, actions=actions)


def _lower_rank(schedule: Schedule, actions: list[Action]) -> list[Action]:
    last, home = schedule.num_stages - 1, schedule.stage_to_rank
    lowered: list[Action] = []
    for action in actions:
        s, j, kind = action.stage, action.microbatch, action.kind
        crosses_prev = s > 0 and home(s - 1) != home(s)
        crosses_next = s < last and home(s + 1) != home(s)
        if kind == Kind.F and crosses_prev:
            lowered.append(Action(s, Kind.RECV_F, j))
        if kind in (Kind.B, Kind.I) and crosses_next:
            lowered.append(Action(s, Kind.RECV_B, j))
        lowered.append(action)
        if kind == Kind.F and crosses_next:
            lowered.append(Action(s, Kind.SEND_F, j))
        if kind in (Kind.B, Kind.I) and crosses_prev:
            lowered.append(Action(s, Kind.SEND_B, j))
    return lowered
