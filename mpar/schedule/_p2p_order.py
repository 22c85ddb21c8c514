"""The order of a lowered schedule's transfers under NCCL's point-to-point rules.

NCCL (and torch's ProcessGroupNCCL) ignores tags: between two ranks, sends and
receives match strictly in the order each side posted them, the operations of one
pair run one after another in posting order, and each completes only once its peer
has posted the match. A receive posted too early therefore blocks every later
operation with that peer, sends included, and two ranks that each send before they
receive what the other sends wait for each other forever.

:func:`receive_posts` derives, from the lowered schedule alone (so that both ends of
every pair derive the same), *where* each rank posts each receive: the schedule is
run in lockstep (ranks in order, each until it reaches a receive whose send has not
happened yet) and each send places its receive on the receiver at the receiver's
current position. Every rank's posts, sends and waits are then a projection of that
one global sequence, in which each send is immediately followed by its receive.
Hence, by induction over the sequence, every operation completes: a wait (the RECV
action) waits only for a send earlier in the sequence, and each pair's operations
come up in the same order on both sides. Sends are posted at their SEND action,
receives before the action the plan names, and a RECV action waits for its
receive.

:func:`check_p2p_order` checks a plan independently: it runs every rank's posts,
sends and waits under NCCL's rules (one queue per pair, heads matched in order,
labels compared) and raises :class:`~mpar.errors.ScheduleError` on a deadlock or a
mismatch. The unit tests run it over every generated schedule, and it refuses the
plan mpar used before (the first receive of every stream posted at the start of the
step), as NCCL would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mpar.errors import ScheduleError
from mpar.schedule._ir import Action, Kind, Schedule

__all__ = ["ReceivePosts", "check_p2p_order", "matching_receive", "receive_posts"]

ReceivePosts = dict[int, list[tuple[Action, ...]]]
"""Per rank, for each of its actions (by index), the RECV actions whose receives it
posts right before that action."""

_SENDS = (Kind.SEND_F, Kind.SEND_B)
_RECEIVES = (Kind.RECV_F, Kind.RECV_B)


def matching_receive(send: Action) -> Action:
    """The RECV action that takes what ``send`` sends (``1SEND_F3`` -> ``2RECV_F3``)."""
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    if send.kind is Kind.SEND_B:
        return Action(send.stage - 1, Kind.RECV_B, send.microbatch)
    raise ScheduleError(f"{send} is not a send")


def receive_posts(schedule: Schedule) -> ReceivePosts:
    """Where each rank posts each of its receives (see the module docstring).

    ``schedule`` is lowered (``mpar.schedule.lower``); a schedule whose receives
    cannot all be matched (it deadlocks with blocking receives) raises
    :class:`~mpar.errors.ScheduleError`, naming where each rank stops.
    """
    ranks = range(schedule.num_ranks)
    lists = [schedule.actions.get(r, []) for r in ranks]
    posts: list[list[list[Action]]] = [[[] for _ in actions] for actions in lists]
    cursor = [0 for _ in ranks]
    posted: set[Action] = set()
    progressed = True
    while progressed:
        progressed = False
        for r in ranks:
            while cursor[r] < len(lists[r]):
                action = lists[r][cursor[r]]
                if action.kind in _RECEIVES and action not in posted:
                    break
                if action.kind in _SENDS:
                    receive = matching_receive(action)
                    dst = schedule.stage_to_rank(receive.stage)
                    if cursor[dst] >= len(lists[dst]):
                        raise ScheduleError(
                            f"{action} on rank {r} sends to rank {dst}, which has no "
                            f"{receive} left to take it\n{schedule.format_grid()}"
                        )
                    posts[dst][cursor[dst]].append(receive)
                    posted.add(receive)
                cursor[r] += 1
                progressed = True
    stuck = [r for r in ranks if cursor[r] < len(lists[r])]
    if stuck:
        where = "; ".join(
            f"rank {r} at step {cursor[r]} ({lists[r][cursor[r]]}), whose send never comes"
            for r in stuck
        )
        grid = schedule.format_grid(mark=(stuck[0], cursor[stuck[0]]), note="waits here")
        raise ScheduleError(f"schedule deadlocks: {where}\n{grid}")
    return {r: [tuple(p) for p in posts[r]] for r in ranks}


# -- the check under NCCL's rules ------------------------------------------------------


@dataclass
class _Op:
    """One posted send or receive, as the check follows it."""

    rank: int
    peer: int
    send: bool
    label: Action
    """The RECV action the transfer is for (a send names its receive)."""
    done: bool = False


@dataclass
class _Rank:
    """One rank's program (its events in order) and where it is."""

    events: list[tuple[str, Action]]
    """``("post", RECV action)``, ``("send", SEND action)``, ``("wait", RECV action)``."""
    at: int = 0
    queues: dict[int, deque[_Op]] = field(default_factory=dict)
    """Peer -> this rank's operations with it not yet completed, in posting order."""
    receives: dict[Action, _Op] = field(default_factory=dict)
    sends: list[_Op] = field(default_factory=list)


def _program(actions: Sequence[Action], posts: Sequence[tuple[Action, ...]]) -> list:
    events: list[tuple[str, Action]] = []
    for index, action in enumerate(actions):
        events.extend(("post", receive) for receive in (posts[index] if index < len(posts) else ()))
        if action.kind in _SENDS:
            events.append(("send", action))
        elif action.kind in _RECEIVES:
            events.append(("wait", action))
    return events


def check_p2p_order(schedule: Schedule, posts: Mapping[int, Sequence[tuple[Action, ...]]]) -> None:
    """Raise :class:`~mpar.errors.ScheduleError` unless every rank's posts (``posts``:
    as :func:`receive_posts` gives them), sends (at SEND actions) and waits (at RECV
    actions, and for every send at the end) complete under NCCL's rules, each send
    matched with the receive of the same transfer."""
    ranks = [
        _Rank(_program(schedule.actions.get(r, []), posts.get(r, ())))
        for r in range(schedule.num_ranks)
    ]
    while True:
        moved = False
        for r, rank in enumerate(ranks):
            moved = _advance(schedule, r, rank) or moved
        moved = _match_heads(schedule, ranks) or moved
        if not moved:
            break
    stuck = [r for r, rank in enumerate(ranks) if rank.at < len(rank.events)]
    unsent = [op for rank in ranks for op in rank.sends if not op.done]
    if stuck or unsent:
        raise ScheduleError(_deadlock(schedule, ranks, stuck, unsent))


def _advance(schedule: Schedule, r: int, rank: _Rank) -> bool:
    """Run ``rank``'s events up to a wait that is not satisfied; True if any ran."""
    start = rank.at
    while rank.at < len(rank.events):
        what, action = rank.events[rank.at]
        if what == "wait":
            op = rank.receives.get(action)
            if op is None:
                raise ScheduleError(
                    f"rank {r} waits for {action} without posting its receive first\n"
                    f"{schedule.format_grid()}"
                )
            if not op.done:
                break
        elif what == "post":
            source = action.stage - 1 if action.kind is Kind.RECV_F else action.stage + 1
            op = _Op(r, schedule.stage_to_rank(source), False, action)
            rank.receives[action] = op
            rank.queues.setdefault(op.peer, deque()).append(op)
        else:
            receive = matching_receive(action)
            op = _Op(r, schedule.stage_to_rank(receive.stage), True, receive)
            rank.sends.append(op)
            rank.queues.setdefault(op.peer, deque()).append(op)
        rank.at += 1
    return rank.at > start


def _match_heads(schedule: Schedule, ranks: list[_Rank]) -> bool:
    """Complete every send at the head of its queue whose peer's head is a receive."""
    moved = False
    for r, rank in enumerate(ranks):
        for peer, queue in rank.queues.items():
            while queue and queue[0].send:
                other = ranks[peer].queues.get(r)
                if not other or other[0].send:
                    break
                send, receive = queue[0], other[0]
                if send.label != receive.label:
                    raise ScheduleError(
                        f"transfers matched out of order: rank {r} sends for {send.label} "
                        f"while rank {peer}'s next receive from it is for {receive.label}\n"
                        f"{schedule.format_grid()}"
                    )
                send.done = receive.done = True
                queue.popleft()
                other.popleft()
                moved = True
    return moved


def _deadlock(schedule: Schedule, ranks: list[_Rank], stuck: list[int], unsent: list[_Op]) -> str:
    lines = [
        "transfers deadlock under NCCL's rules (per-pair order, each operation completes "
        "only once matched):"
    ]
    for r, rank in enumerate(ranks):
        heads = ", ".join(
            f"{'send' if q[0].send else 'receive'} for {q[0].label} with rank {peer}"
            for peer, q in sorted(rank.queues.items())
            if q
        )
        if r in stuck:
            _, action = rank.events[rank.at]
            lines.append(f"  rank {r} waits for {action}; its queues start with: {heads}")
        elif heads:
            lines.append(f"  rank {r} is done; its queues still start with: {heads}")
    if not stuck and unsent:
        lines.append(f"  {len(unsent)} sends never matched")
    return "\n".join([*lines, schedule.format_grid()])
