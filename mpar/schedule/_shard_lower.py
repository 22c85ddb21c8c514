"""``lower_sharding``: insert UNSHARD / RESHARD / REDUCE_GRAD actions for ZeRO.

The runtime executes them with :class:`mpar.shard.ShardedStages`
(``unshard(s)``, ``reshard(s)``, ``reduce_grads(s)``). Policy, per rank and
per stage ``s`` it holds:

* ``sREDUCE_GRAD`` (every ZeRO stage; at stage 0 it is the all-reduce
  point) right after ``s``'s last backward of the step (its last B, or W
  when the backward is split) and after the SEND_B that directly follows it,
  so the input gradient leaves for the previous stage first. None in a
  forward-only schedule.
* ZeRO-3 only: ``sUNSHARD`` before ``s``'s first action of the step (before
  the RECV_F of its first forward, so the gather does not wait behind the
  transfer's consumer) and ``sRESHARD`` after its last action (after the
  REDUCE_GRAD). A stage stays gathered from its first to its last action:
  one gather per stage per step, at the price of holding its parameters
  while the rank works on other stages.
* ``reshard_gap=k`` (ZeRO-3): where all forwards of ``s`` end before its
  first backward starts and at least ``k`` compute actions of other stages
  run in between (GPipe, looped/interleaved chunks), also
  ``sRESHARD`` after the forward phase and ``sUNSHARD`` before the
  backward phase: two gathers per step, less memory during the gap.
* ``prefetch=k`` (ZeRO-3): every ``sUNSHARD`` moves ``k`` compute actions
  earlier (never before the start of the step nor before the previous
  ``sRESHARD``), so the gather of the next unit overlaps the current one's
  compute. The runtime starts the gather at UNSHARD and waits for it at the
  stage's next compute action; the price is holding the next unit's
  parameters ``k`` actions sooner.

Rank 0 of ``simple(4, 2, 2)`` (stages 0, 2) lowered for ZeRO-3::

    0UNSHARD 0F0 0F1 2UNSHARD 2F0 2F1 2B0 2B1 2REDUCE_GRAD 2RESHARD
    0B0 0B1 0REDUCE_GRAD 0RESHARD

The same with ``prefetch=1``: stage 2's gather starts before ``0F1`` runs::

    0UNSHARD 0F0 2UNSHARD 0F1 2F0 2F1 2B0 2B1 2REDUCE_GRAD 2RESHARD
    0B0 0B1 0REDUCE_GRAD 0RESHARD
"""

from __future__ import annotations

import dataclasses

from mpar.errors import ScheduleError
from mpar.schedule._ir import COMPUTE_KINDS, Action, Kind, Schedule

__all__ = ["lower_sharding"]

_SHARDING_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})


def lower_sharding(
    schedule: Schedule, zero_stage: int, *, reshard_gap: int | None = None, prefetch: int = 0
) -> Schedule:
    """A copy of ``schedule`` with the sharding actions of ZeRO stage ``zero_stage``.

    Works on compute-only and communication-lowered schedules alike. See the
    module docstring for where each action goes.
    """
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ScheduleError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if reshard_gap is not None and reshard_gap < 1:
        raise ScheduleError(f"reshard_gap must be >= 1 (or None), got {reshard_gap}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ScheduleError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if any(a.kind in _SHARDING_KINDS for a in schedule.iter_actions()):
        raise ScheduleError(
            "schedule already has UNSHARD/RESHARD/REDUCE_GRAD actions; lower it only once"
        )
    actions = {
        rank: _prefetch(_lower_rank(acts, zero_stage, reshard_gap), prefetch)
        for rank, acts in schedule.actions.items()
    }
    return dataclasses.replace(schedule, actions=actions)


def _lower_rank(actions: list[Action], zero_stage: int, gap: int | None) -> list[Action]:
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for s in sorted({a.stage for a in actions}):
        where = [i for i, a in enumerate(actions) if a.stage == s]
        backward = [i for i in where if actions[i].kind in (Kind.B, Kind.W)]
        if backward:
            done = _past_send(actions, backward[-1], Kind.SEND_B)
            after.setdefault(done, []).append(Action(s, Kind.REDUCE_GRAD))
        if zero_stage < 3:
            continue
        before.setdefault(where[0], []).append(Action(s, Kind.UNSHARD))
        after.setdefault(where[-1], []).append(Action(s, Kind.RESHARD))
        if gap is not None:
            _split_phases(actions, s, where, gap, before, after)
    lowered: list[Action] = []
    for i, action in enumerate(actions):
        lowered += before.get(i, [])
        lowered.append(action)
        lowered += after.get(i, [])
    return lowered


def _prefetch(actions: list[Action], k: int) -> list[Action]:
    """Move every UNSHARD ``k`` compute actions earlier (see the module docstring)."""
    out: list[Action] = []
    for action in actions:
        if action.kind != Kind.UNSHARD or k == 0:
            out.append(action)
            continue
        target, passed = len(out), 0
        while target > 0 and passed < k:
            prev = out[target - 1]
            if prev.stage == action.stage and prev.kind in _SHARDING_KINDS:
                break  # not before this stage's previous RESHARD
            target -= 1
            passed += prev.kind in COMPUTE_KINDS
        out.insert(target, action)
    return out


def _past_send(actions: list[Action], i: int, send: Kind) -> int:
    """``i``, or the index of the ``send`` of the same stage and microbatch right after it."""
    a = actions[i]
    nxt = actions[i + 1] if i + 1 < len(actions) else None
    if (
        nxt is not None
        and nxt.kind == send
        and (nxt.stage, nxt.microbatch) == (a.stage, a.microbatch)
    ):
        return i + 1
    return i


def _before_recv(actions: list[Action], i: int, recv: Kind) -> int:
    """``i``, or the index of the ``recv`` of the same stage and microbatch right before it."""
    a = actions[i]
    prev = actions[i - 1] if i > 0 else None
    if (
        prev is not None
        and prev.kind == recv
        and (prev.stage, prev.microbatch) == (a.stage, a.microbatch)
    ):
        return i - 1
    return i


def _split_phases(
    actions: list[Action],
    s: int,
    where: list[int],
    gap: int,
    before: dict[int, list[Action]],
    after: dict[int, list[Action]],
) -> None:
    forwards = [i for i in where if actions[i].kind == Kind.F]
    backwards = [i for i in where if actions[i].kind in (Kind.B, Kind.I)]
    if not forwards or not backwards or forwards[-1] > backwards[0]:
        return
    others = sum(
        1
        for a in actions[forwards[-1] + 1 : backwards[0]]
        if a.kind in COMPUTE_KINDS and a.stage != s
    )
    if others < gap:
        return
    after.setdefault(_past_send(actions, forwards[-1], Kind.SEND_F), []).append(
        Action(s, Kind.RESHARD)
    )
    before.setdefault(_before_recv(actions, backwards[0], Kind.RECV_B), []).insert(
        0, Action(s, Kind.UNSHARD)
    )
