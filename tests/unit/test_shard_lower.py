"""``lower_sharding``: where UNSHARD / RESHARD / REDUCE_GRAD go (pure, no processes)."""

from __future__ import annotations

import itertools

import pytest

from mpar.errors import ScheduleError
from mpar.schedule import (
    Action,
    Kind,
    Schedule,
    build_schedule,
    lower_communication,
    lower_sharding,
    simulate,
    validate,
)

SHARDING = {Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD}
BACKWARD = {Kind.B, Kind.I, Kind.W}
COMPUTE = {Kind.F, Kind.B, Kind.I, Kind.W}

GRID = [
    case
    for case in itertools.product(
        ["simple", "interleaved"],  # pipeline
        [1, 2, 4],  # ranks
        [1, 2],  # virtual stages
        [1, 4],  # microbatches
        [False, True],  # communication lowered first
        [0, 1, 2, 3],  # zero stage
        [None, 1],  # reshard_gap
    )
    # interleaved chunks need microbatches in multiples of ranks; the gap is ZeRO-3's
    if not (case[0] == "interleaved" and case[2] > 1 and case[3] % case[1])
    and not (case[6] is not None and case[5] != 3)
]


def _lowered(pipeline, p, v, m, comm, zero, gap, forward_only=False):
    schedule = build_schedule(pipeline, p, m, virtual_stages=v, forward_only=forward_only)
    if comm:
        schedule = lower_communication(schedule)
    return schedule, lower_sharding(schedule, zero, reshard_gap=gap)


def _check_rank(actions, zero, training):
    gathered: set[int] = set()
    reduced: set[int] = set()
    for action in actions:
        s, kind = action.stage, action.kind
        if kind == Kind.UNSHARD:
            assert s not in gathered, f"{action} while already gathered"
            gathered.add(s)
        elif kind == Kind.RESHARD:
            assert s in gathered, f"{action} while not gathered"
            gathered.discard(s)
        elif kind == Kind.REDUCE_GRAD:
            assert s not in reduced
            reduced.add(s)
        elif kind in COMPUTE:
            assert s not in reduced, f"{action} after {s}REDUCE_GRAD"
            if zero == 3:
                assert s in gathered, f"{action} runs with stage {s} resharded"
    assert not gathered, f"stages {gathered} still gathered at the end of the step"
    stages = {a.stage for a in actions if a.kind in COMPUTE}
    assert reduced == (stages if training else set())


@pytest.mark.parametrize(("pipeline", "p", "v", "m", "comm", "zero", "gap"), GRID)
def test_lowered_schedules_validate_simulate_and_keep_stages_gathered_when_used(
    pipeline, p, v, m, comm, zero, gap
):
    schedule, lowered = _lowered(pipeline, p, v, m, comm, zero, gap)
    validate(lowered)
    simulate(lowered)  # no deadlock
    for rank, actions in lowered.actions.items():
        _check_rank(actions, zero, training=True)
        # Removing the inserted actions gives back the input, in order.
        assert [a for a in actions if a.kind not in SHARDING] == schedule.actions[rank]
        kinds = {a.kind for a in actions}
        assert (Kind.UNSHARD in kinds) == (zero == 3)


def test_reduce_grad_follows_the_last_backward_and_its_send():
    _, lowered = _lowered("simple", 2, 1, 2, True, 2, None)
    assert [str(a) for a in lowered.actions[1]][-3:] == ["1B1", "1SEND_B1", "1REDUCE_GRAD"]
    assert [str(a) for a in lowered.actions[0]][-2:] == ["0B1", "0REDUCE_GRAD"]


def test_zero3_gathers_once_per_stage_from_first_to_last_action():
    _, lowered = _lowered("simple", 2, 2, 2, False, 3, None)
    assert " ".join(str(a) for a in lowered.actions[0]) == (
        "0UNSHARD 0F0 0F1 2UNSHARD 2F0 2F1 2B0 2B1 2REDUCE_GRAD 2RESHARD "
        "0B0 0B1 0REDUCE_GRAD 0RESHARD"
    )


def test_unshard_comes_before_the_receive_of_the_first_forward():
    _, lowered = _lowered("simple", 2, 1, 1, True, 3, None)
    assert [str(a) for a in lowered.actions[1]][:3] == ["1UNSHARD", "1RECV_F0", "1F0"]


def test_reshard_gap_frees_a_stage_between_its_forward_and_backward_phases():
    _, lowered = _lowered("simple", 2, 2, 2, True, 3, 1)
    text = [str(a) for a in lowered.actions[0]]
    assert text.count("0UNSHARD") == 2 and text.count("0RESHARD") == 2
    assert text[text.index("0SEND_F1") + 1] == "0RESHARD"
    assert text[text.index("0RECV_B0") - 1] == "0UNSHARD"
    # A gap of fewer compute actions than asked keeps the stage gathered.
    _, kept = _lowered("simple", 2, 2, 2, True, 3, 100)
    assert [str(a) for a in kept.actions[0]].count("0UNSHARD") == 1


@pytest.mark.parametrize("zero", [0, 3])
def test_forward_only_schedules_have_no_gradient_reduction(zero):
    _, lowered = _lowered("interleaved", 2, 2, 4, True, zero, None, forward_only=True)
    validate(lowered)
    for actions in lowered.actions.values():
        _check_rank(actions, zero, training=False)


def test_bad_arguments_and_lowering_twice_are_errors():
    schedule = build_schedule("simple", 2, 2)
    with pytest.raises(ScheduleError, match="zero_stage must be 0, 1, 2 or 3"):
        lower_sharding(schedule, 4)
    with pytest.raises(ScheduleError, match="reshard_gap must be >= 1"):
        lower_sharding(schedule, 3, reshard_gap=0)
    with pytest.raises(ScheduleError, match="lower it only once"):
        lower_sharding(lower_sharding(schedule, 1), 1)


def test_split_backward_reduces_after_the_last_weight_gradient():
    actions = {0: [Action.parse(t) for t in ["0F0", "0I0", "0F1", "0I1", "0W0", "0W1"]]}
    lowered = lower_sharding(Schedule(1, 1, 2, actions), 3)
    validate(lowered)
    assert [str(a) for a in lowered.actions[0]][-3:] == ["0W1", "0REDUCE_GRAD", "0RESHARD"]


def test_prefetch_starts_each_gather_one_compute_action_early():
    _, lowered = _lowered("simple", 2, 2, 2, False, 3, None)
    prefetched = lower_sharding(build_schedule("simple", 2, 2, virtual_stages=2), 3, prefetch=1)
    assert " ".join(str(a) for a in prefetched.actions[0]) == (
        "0UNSHARD 0F0 2UNSHARD 0F1 2F0 2F1 2B0 2B1 2REDUCE_GRAD 2RESHARD "
        "0B0 0B1 0REDUCE_GRAD 0RESHARD"
    )
    # With the phases split, the backward's gather never moves above the forward's RESHARD.
    split = lower_sharding(
        build_schedule("simple", 2, 2, virtual_stages=2), 3, reshard_gap=1, prefetch=5
    )
    text = [str(a) for a in split.actions[0]]
    second = len(text) - 1 - text[::-1].index("0UNSHARD")
    assert text[second - 1] == "0RESHARD"
    assert lowered.actions[0] != prefetched.actions[0]


PREFETCH_GRID = [
    case
    for case in itertools.product(
        ["simple", "interleaved"], [1, 2, 4], [1, 2], [1, 4], [False, True], [None, 1], [1, 2]
    )
    if not (case[0] == "interleaved" and case[2] > 1 and case[3] % case[1])
]


@pytest.mark.parametrize(("pipeline", "p", "v", "m", "comm", "gap", "k"), PREFETCH_GRID)
def test_prefetched_gathers_run_k_compute_actions_ahead_or_as_early_as_allowed(
    pipeline, p, v, m, comm, gap, k
):
    schedule = build_schedule(pipeline, p, m, virtual_stages=v)
    if comm:
        schedule = lower_communication(schedule)
    lowered = lower_sharding(schedule, 3, reshard_gap=gap, prefetch=k)
    validate(lowered)
    simulate(lowered)
    for rank, actions in lowered.actions.items():
        _check_rank(actions, 3, training=True)
        assert [a for a in actions if a.kind not in SHARDING] == schedule.actions[rank]
        for i, action in enumerate(actions):
            if action.kind != Kind.UNSHARD:
                continue
            s = action.stage
            first_use = next(
                j
                for j in range(i + 1, len(actions))
                if actions[j].stage == s and actions[j].kind in COMPUTE
            )
            ahead = sum(a.kind in COMPUTE for a in actions[i:first_use])
            # Fewer only when the walk back hit the step's start or this stage's last action.
            boundary = max(
                (j for j in range(i) if actions[j].stage == s and actions[j].kind in SHARDING),
                default=-1,
            )
            blocked = not any(a.kind in COMPUTE for a in actions[boundary + 1 : i])
            assert ahead == k or (ahead < k and blocked), (rank, i, action, ahead)


def test_prefetch_must_be_a_non_negative_int():
    with pytest.raises(ScheduleError, match="prefetch must be an int >= 0"):
        lower_sharding(build_schedule("simple", 2, 2), 3, prefetch=-1)
