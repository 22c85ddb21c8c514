"""simulate: the sweep, exact bubble formulas, deadlocks, costs and lowering."""

from __future__ import annotations

from fractions import Fraction

import pytest

from mpar.errors import ScheduleError
from mpar.schedule import (
    Action,
    Kind,
    Schedule,
    SimulationResult,
    StageCosts,
    build_schedule,
    lower_communication,
    simulate,
)


def _bubble(result: SimulationResult) -> Fraction:
    """The bubble fraction computed exactly (unit costs are integers)."""
    busy = sum(Fraction(b) for b in result.busy)
    return 1 - busy / (len(result.busy) * Fraction(result.makespan))


def _valid(pipeline: str, p: int, v: int, m: int) -> bool:
    return pipeline == "simple" or v == 1 or m % p == 0


@pytest.mark.parametrize("v", [1, 2, 4])
@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_sweep_validates_and_simulates(pipeline: str, v: int) -> None:
    """p in 1..8, m in 1..32: every valid combination simulates with the exact bubble."""
    for p in range(1, 9):
        for m in range(1, 33):
            if not _valid(pipeline, p, v, m):
                with pytest.raises(ScheduleError, match="multiple of the pipeline degree"):
                    build_schedule(pipeline, p, m, virtual_stages=v)  # type: ignore[arg-type]
                continue
            result = simulate(build_schedule(pipeline, p, m, virtual_stages=v))  # type: ignore[arg-type]
            # F=1, B=2: the makespan is 3 * (time slots of the critical rank)
            slots = v * m + p - 1 if pipeline == "interleaved" else (v - 1) * max(m, p) + m + p - 1
            assert result.makespan == 3 * slots, (pipeline, p, v, m)
            assert _bubble(result) == 1 - Fraction(v * m, slots)
            assert result.busy == (3.0 * v * m,) * p


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, 32])
def test_bubble_v1_is_gpipe_formula(p: int, m: int) -> None:
    expected = Fraction(p - 1, m + p - 1)
    for pipeline in ("simple", "interleaved"):
        result = simulate(build_schedule(pipeline, p, m))
        assert _bubble(result) == expected
        assert result.bubble_fraction == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_bubble_interleaved_virtual(p: int, v: int, rounds: int) -> None:
    """Megatron's relative form: (p-1)/(v*m + p-1), below the v=1 figure."""
    m = rounds * p
    result = simulate(build_schedule("interleaved", p, m, virtual_stages=v))
    assert _bubble(result) == Fraction(p - 1, v * m + p - 1)
    assert _bubble(result) < _bubble(simulate(build_schedule("interleaved", p, m)))


def test_bubble_formula_holds_for_any_uniform_costs() -> None:
    for backward in (1.0, 2.0, 3.0):
        costs = StageCosts.uniform(8, forward=1.0, backward=backward)
        result = simulate(build_schedule("interleaved", 4, 8, virtual_stages=2), costs)
        assert result.makespan == (1 + backward) * (2 * 8 + 3)


def test_result_fields() -> None:
    result = simulate(build_schedule("interleaved", 2, 4))
    assert result.makespan == 15
    assert result.busy == (12.0, 12.0)
    assert result.idle == (3.0, 3.0)
    assert result.bubble_fraction == pytest.approx(0.2)
    assert result.peak_in_flight == (2, 1)
    first = result.timeline[1][0]
    assert (str(first.action), first.start, first.end) == ("1F0", 1.0, 2.0)
    assert result.to_dict()["peak_in_flight"] == [2, 1]


def _deadlocked() -> Schedule:
    """Valid (counts, order, placement) but rank 1 wants microbatch 1 first."""
    return Schedule(
        2,
        2,
        2,
        {
            0: [Action.parse(t) for t in ["0F0", "0B0", "0F1", "0B1"]],
            1: [Action.parse(t) for t in ["1F1", "1B1", "1F0", "1B0"]],
        },
    )


def test_deadlock_names_waiting_ranks() -> None:
    with pytest.raises(ScheduleError) as info:
        simulate(_deadlocked())
    message = str(info.value)
    assert message.splitlines()[:3] == [
        "schedule deadlocks: no rank can start its next action",
        "  rank 0 waits at step 1 (0B0) for 1B0 (rank 1 step 3)",
        "  rank 1 waits at step 0 (1F1) for 0F1 (rank 0 step 2)",
    ]
    assert "rank 0 0F0[0B0]0F1 0B1  <-- waits here" in message


def test_deadlock_in_lowered_schedule() -> None:
    # 1F1B on 2 ranks, but rank 1 wants microbatch 1's activations before it runs 1B0,
    # and rank 0 sends them only after 0B0
    lowered = lower_communication(
        Schedule(
            2,
            2,
            2,
            {r: [Action.parse(f"{r}{t}") for t in ("F0", "B0", "F1", "B1")] for r in (0, 1)},
        )
    )
    row = lowered.actions[1]
    row.insert(1, row.pop(row.index(Action.parse("1RECV_F1"))))
    with pytest.raises(ScheduleError, match=r"rank 1 waits at step 1 \(1RECV_F1\) for 0SEND_F1"):
        simulate(lowered)


def test_invalid_schedule_is_rejected_before_simulation() -> None:
    schedule = build_schedule("simple", 2, 2)
    schedule.actions[0].pop()
    with pytest.raises(ScheduleError, match="invalid schedule"):
        simulate(schedule)


@pytest.mark.parametrize(("pipeline", "v"), [("simple", 1), ("interleaved", 1), ("interleaved", 2)])
def test_lowering_keeps_the_timeline(pipeline: str, v: int) -> None:
    costs = StageCosts([1.0, 1.5, 0.5, 1.0] * v, [2.0, 2.5, 1.0, 3.0] * v, comm=0.25)
    schedule = build_schedule(pipeline, 4, 8, virtual_stages=v)  # type: ignore[arg-type]
    plain = simulate(schedule, costs)
    lowered = simulate(lower_communication(schedule), costs)
    assert lowered.makespan == plain.makespan
    assert lowered.busy == plain.busy
    computed = [[t for t in row if t.end > t.start] for row in lowered.timeline.values()]
    assert computed == list(plain.timeline.values())


def test_lowered_actions_surround_compute() -> None:
    lowered = lower_communication(build_schedule("simple", 2, 1))
    assert [str(a) for a in lowered.actions[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]
    assert [str(a) for a in lowered.actions[1]] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]
    single = lower_communication(build_schedule("simple", 1, 2, virtual_stages=2))
    assert not any(a.kind.value.startswith(("SEND", "RECV")) for a in single.iter_actions())


def test_comm_latency_delays_each_hop() -> None:
    costs = StageCosts.uniform(2, comm=0.5)
    result = simulate(build_schedule("simple", 2, 1), costs)
    # 0F0 [0,1] -> +0.5 -> 1F0 [1.5,2.5] -> 1B0 [2.5,4.5] -> +0.5 -> 0B0 [5,7]
    assert result.makespan == 7.0


def test_split_backward_costs() -> None:
    schedule = build_schedule("simple", 2, 1)
    for rank, actions in schedule.actions.items():
        split = []
        for a in actions:
            if a.kind == Kind.B:
                split += [
                    Action(a.stage, Kind.I, a.microbatch),
                    Action(a.stage, Kind.W, a.microbatch),
                ]
            else:
                split.append(a)
        schedule.actions[rank] = split
    result = simulate(schedule)  # F=1, I=1, W=1
    assert result.makespan == 5.0  # 0F0, 1F0, 1I0, then 0I0 while rank 1 runs 1W0, 0W0
    assert result.peak_in_flight == (1, 1)


def test_stage_costs_checks() -> None:
    with pytest.raises(ScheduleError, match="differ in length"):
        StageCosts([1.0], [1.0, 2.0])
    with pytest.raises(ScheduleError, match="backward must be finite and >= 0"):
        StageCosts([1.0], [-1.0])
    with pytest.raises(ScheduleError, match="comm must be finite"):
        StageCosts([1.0], [1.0], comm=float("nan"))
    with pytest.raises(ScheduleError, match="costs cover 1 stages but the schedule has 2"):
        simulate(build_schedule("simple", 2, 1), StageCosts([1.0], [1.0]))
