"""The transfers' posting order (``receive_posts``) holds under NCCL's rules, checked by
``check_p2p_order``, for every generated schedule; the orders mpar used before do not."""

from __future__ import annotations

import itertools

import pytest

from mpar.errors import ScheduleError
from mpar.schedule import (
    PIPELINES,
    Action,
    Kind,
    Schedule,
    check_p2p_order,
    executable_schedule,
    receive_posts,
)

RECEIVES = (Kind.RECV_F, Kind.RECV_B)


def _schedules():
    for name, p, v, m, forward_only, zero in itertools.product(
        PIPELINES, [2, 3, 4], [1, 2], [1, 3, 4, 8], [False, True], [None, 3]
    ):
        if name == "zbv" and v != 2:
            continue
        try:
            yield executable_schedule(
                name, p, m, virtual_stages=v, forward_only=forward_only, zero_stage=zero
            )
        except ScheduleError:
            continue  # (a combination the generator refuses, e.g. interleaved v2 with m % p)


def test_every_generated_schedule_posts_its_transfers_in_an_order_nccl_completes():
    checked = 0
    for schedule in _schedules():
        posts = receive_posts(schedule)
        check_p2p_order(schedule, posts)
        for rank, actions in schedule.actions.items():
            assert len(posts[rank]) == len(actions)
            receives = [a for a in actions if a.kind in RECEIVES]
            posted = [a for at in posts[rank] for a in at]
            assert sorted(map(str, posted)) == sorted(map(str, receives))  # each once
            for index, at in enumerate(posts[rank]):  # and before the RECV that waits
                assert all(actions.index(a) >= index for a in at)
        checked += 1
    assert checked > 150


def _first_of_each_stream_early(schedule: Schedule):
    """The order mpar used before: at the start of the step the first receive of every
    stream (stage and direction), and the next one right after each RECV."""
    posts = {}
    for rank, actions in schedule.actions.items():
        at: list[list[Action]] = [[] for _ in actions]
        streams: dict[tuple[Kind, int], list[Action]] = {}
        for a in actions:
            if a.kind in RECEIVES:
                streams.setdefault((a.kind, a.stage), []).append(a)
        for stream in streams.values():
            at[0].append(stream[0])
        for index, a in enumerate(actions):
            if a.kind in RECEIVES:
                stream = streams[(a.kind, a.stage)]
                following = stream[stream.index(a) + 1 :]
                if following:
                    at[index + 1].append(following[0])
        posts[rank] = [tuple(p) for p in at]
    return posts


def _at_each_recv(schedule: Schedule):
    """Each receive posted at its own RECV action (no early receives at all)."""
    return {
        rank: [(a,) if a.kind in RECEIVES else () for a in actions]
        for rank, actions in schedule.actions.items()
    }


@pytest.mark.parametrize("plan", [_first_of_each_stream_early, _at_each_recv])
def test_the_orders_mpar_used_before_deadlock_under_nccl_rules(plan):
    schedule = executable_schedule("interleaved", 2, 4)
    with pytest.raises(ScheduleError, match="transfers deadlock under NCCL's rules") as info:
        check_p2p_order(schedule, plan(schedule))
    text = str(info.value)
    assert "rank 0 waits for 0RECV_B" in text and "rank 1 waits for 1RECV_F" in text


def test_a_receive_posted_out_of_the_send_order_is_a_mismatch():
    schedule = executable_schedule("simple", 2, 2)
    posts = receive_posts(schedule)
    rank1 = [list(at) for at in posts[1]]
    first = next(i for i, at in enumerate(rank1) if at)
    rank1[first] = rank1[first][::-1]  # 1RECV_F1 before 1RECV_F0
    assert len(rank1[first]) == 2
    with pytest.raises(ScheduleError, match="transfers matched out of order: rank 0 sends"):
        check_p2p_order(schedule, {**posts, 1: [tuple(at) for at in rank1]})


def test_a_receive_whose_send_never_comes_is_refused_with_the_grid():
    schedule = executable_schedule("interleaved", 2, 2)
    actions = {r: list(a) for r, a in schedule.actions.items()}
    actions[0] = [a for a in actions[0] if a.kind is not Kind.SEND_F or a.microbatch != 1]
    broken = Schedule(schedule.num_stages, 2, 2, actions)
    with pytest.raises(ScheduleError, match=r"rank 1 at step \d+ \(1RECV_F1\), whose send never"):
        receive_posts(broken)


def test_the_posts_of_1f1b_put_the_warm_up_receives_first():
    posts = receive_posts(executable_schedule("interleaved", 2, 4))
    assert [str(a) for a in posts[1][0]] == ["1RECV_F0", "1RECV_F1"]  # both warm-up sends
    assert sum(len(at) for at in posts[0]) == 4  # rank 0: one gradient per microbatch
