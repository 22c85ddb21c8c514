"""validate: doctored schedules are caught and the grid marks the bad cell."""

from __future__ import annotations

import copy

import pytest

from mpar.errors import ScheduleError
from mpar.schedule import Action, Kind, Schedule, build_schedule, lower_communication, validate


def _interleaved_2x4() -> Schedule:
    return copy.deepcopy(build_schedule("interleaved", 2, 4))


def _error(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return str(info.value)


def test_generated_schedules_validate() -> None:
    for pipeline in ("simple", "interleaved"):
        validate(build_schedule(pipeline, 4, 8, virtual_stages=2))
        validate(lower_communication(build_schedule(pipeline, 4, 8)))


def test_missing_backward_marks_the_row() -> None:
    schedule = _interleaved_2x4()
    schedule.actions[1].remove(Action(1, Kind.B, 2))
    message = _error(schedule)
    assert message.splitlines()[0] == (
        "invalid schedule: stage 1 microbatch 2 has no B (or I and W) (expected exactly one)"
    )
    assert "rank 1 1F0 1B0 1F1 1B1 1F2 1F3 1B3  <-- stage 1 microbatch 2 has no B" in message


def test_backward_before_forward_marks_the_cell() -> None:
    schedule = _interleaved_2x4()
    rank0 = schedule.actions[0]
    rank0[0], rank0[2] = rank0[2], rank0[0]  # 0B0 0F1 0F0 ...
    message = _error(schedule)
    assert message == (
        "invalid schedule: 0B0 runs before 0F0\n"
        "step   0   1   2   3   4   5   6   7\n"
        "rank 0[0B0]0F1 0F0 0F2 0B1 0F3 0B2 0B3  <-- 0B0 runs before 0F0\n"
        "rank 1 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    )


def test_duplicated_forward_marks_the_second_copy() -> None:
    schedule = _interleaved_2x4()
    schedule.actions[1].insert(3, Action(1, Kind.F, 1))
    message = _error(schedule)
    assert "1F1 appears twice (first at rank 1 step 2)" in message
    assert "1F1[1F1]1B1" in message


def test_stage_on_wrong_rank() -> None:
    schedule = _interleaved_2x4()
    schedule.actions[0][3] = Action(1, Kind.F, 2)
    message = _error(schedule)
    assert "1F2: stage 1 belongs on rank 1, not 0" in message
    assert "0B0[1F2]0B1" in message


@pytest.mark.parametrize(
    ("doctor", "match"),
    [
        (lambda s: s.actions[0].append(Action(5, Kind.F, 0)), "stage out of range 0..1"),
        (lambda s: s.actions[0].append(Action(0, Kind.F, 9)), "microbatch out of range 0..3"),
        (lambda s: s.actions.update({2: []}), "rank 2 does not exist"),
        (lambda s: s.actions[0].remove(Action(0, Kind.F, 3)), "stage 0 microbatch 3 has no F"),
        (lambda s: s.actions[0].remove(Action(0, Kind.B, 3)), "has no B"),
        (lambda s: s.actions[0].append(Action(0, Kind.I, 1)), "has both B and I/W"),
    ],
)
def test_other_doctored_schedules(doctor: object, match: str) -> None:
    schedule = _interleaved_2x4()
    doctor(schedule)  # type: ignore[operator]
    assert match in _error(schedule)


def test_split_backward_needs_weight_part() -> None:
    schedule = _interleaved_2x4()
    for rank, actions in schedule.actions.items():
        schedule.actions[rank] = [
            Action(a.stage, Kind.I, a.microbatch) if a.kind == Kind.B else a for a in actions
        ]
    assert "stage 0 microbatch 0 has no W" in _error(schedule)
    for actions in schedule.actions.values():
        actions += [Action(a.stage, Kind.W, a.microbatch) for a in actions if a.kind == Kind.I]
    validate(schedule)
    schedule.actions[0].insert(0, schedule.actions[0].pop())  # a W before its I
    assert "0W3 runs before 0I3" in _error(schedule)


def test_lowered_schedule_checks_sends_and_receives() -> None:
    lowered = lower_communication(build_schedule("interleaved", 2, 4))
    validate(lowered)
    broken = copy.deepcopy(lowered)
    broken.actions[1].remove(Action(1, Kind.RECV_F, 2))
    assert "lowered schedule lacks 1RECV_F2" in _error(broken)
    early = copy.deepcopy(lowered)
    early.actions[0].insert(
        0, early.actions[0].pop(early.actions[0].index(Action(0, Kind.SEND_F, 1)))
    )
    assert "0SEND_F1 runs before 0F1" in _error(early)
    with pytest.raises(ScheduleError, match="already has communication"):
        lower_communication(lowered)


def test_receives_follow_the_order_of_the_sends() -> None:
    """One stream per pair of stages and direction: rank 1 cannot take microbatch 1's
    activations before microbatch 0's, which rank 0 sent first."""
    lowered = lower_communication(build_schedule("simple", 2, 2))
    assert [str(a) for a in lowered.actions[1][:4]] == ["1RECV_F0", "1F0", "1RECV_F1", "1F1"]
    swapped = copy.deepcopy(lowered)
    row = swapped.actions[1]
    row[:4] = [row[2], row[0], row[1], row[3]]  # 1RECV_F1 1RECV_F0 1F0 1F1
    message = _error(swapped)
    assert "1RECV_F1 comes before 1RECV_F0, but stage 0 sends microbatch 0 first" in message
