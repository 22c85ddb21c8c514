"""The schedule IR: actions, their text form, and the Schedule container."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpar.errors import ScheduleError
from mpar.schedule import Action, Kind, Schedule, build_schedule

_STAGE_WIDE = [Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD]


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("1F3", Action(1, Kind.F, 3)),
        ("0B7", Action(0, Kind.B, 7)),
        ("12I0", Action(12, Kind.I, 0)),
        ("3W11", Action(3, Kind.W, 11)),
        ("2SEND_F5", Action(2, Kind.SEND_F, 5)),
        ("2RECV_B5", Action(2, Kind.RECV_B, 5)),
        ("0UNSHARD", Action(0, Kind.UNSHARD)),
        ("4REDUCE_GRAD", Action(4, Kind.REDUCE_GRAD)),
    ],
)
def test_action_text_form(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text


@st.composite
def _actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(Kind)))
    stage = draw(st.integers(0, 10_000))
    if kind in _STAGE_WIDE:
        return Action(stage, kind)
    return Action(stage, kind, draw(st.integers(0, 10_000)))


@given(_actions())
def test_action_round_trip(action: Action) -> None:
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    "text", ["", "F3", "1X3", "1f3", "-1F3", "1F", "1UNSHARD2", "1F3x", "1SEND3", "one"]
)
def test_bad_action_text_names_it(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action") as info:
        Action.parse(text)
    assert repr(text) in str(info.value)


def test_action_rejects_bad_fields() -> None:
    with pytest.raises(ScheduleError, match="needs a microbatch"):
        Action(0, Kind.F)
    with pytest.raises(ScheduleError, match="takes no microbatch"):
        Action(0, Kind.RESHARD, 1)
    with pytest.raises(ScheduleError, match="stage must be >= 0"):
        Action(-1, Kind.F, 0)


def test_schedule_placement_helpers() -> None:
    schedule = build_schedule("interleaved", 4, 8, virtual_stages=2)
    assert schedule.num_stages == 8 and schedule.virtual_stages == 2
    assert [schedule.stage_to_rank(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert schedule.stages_of(1) == [1, 5]
    assert not schedule.is_forward_only
    assert build_schedule("simple", 2, 2, forward_only=True).is_forward_only
    with pytest.raises(ScheduleError, match="stage 8 out of range"):
        schedule.stage_to_rank(8)
    with pytest.raises(ScheduleError, match="rank 4 out of range"):
        schedule.stages_of(4)


def test_schedule_rejects_bad_shape() -> None:
    with pytest.raises(ScheduleError, match="multiple of num_ranks"):
        Schedule(3, 2, 1, {})
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer"):
        Schedule(2, 2, 0, {})


def test_schedule_dict_round_trip() -> None:
    schedule = build_schedule("interleaved", 2, 4, virtual_stages=2)
    again = Schedule.from_dict(schedule.to_dict())
    assert again == schedule
    assert again.to_dict()["actions"]["0"][:3] == ["0F0", "0F1", "2F0"]


def test_schedule_package_is_pure() -> None:
    """mpar.schedule must not import torch (it runs without processes or devices)."""
    package = Path(__file__).parents[2] / "mpar" / "schedule"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torch" for n in names), path
