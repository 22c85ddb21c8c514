"""The zero-bubble generator: valid, 1F1B's memory, less bubble, in the registry."""

from __future__ import annotations

import itertools

import pytest

from mpar.config import load_config
from mpar.errors import ConfigError, ScheduleError
from mpar.schedule import (
    PIPELINES,
    Kind,
    build_schedule,
    interleaved,
    lower_communication,
    lower_sharding,
    peak_in_flight,
    read_csv,
    schedule_from_csv,
    schedule_to_csv,
    simulate,
    validate,
    write_csv,
    zero_bubble,
    zero_bubble_allowance,
    zero_bubble_peak,
)

SHAPES = [
    (p, v, m)
    for p, v, m in itertools.product([1, 2, 3, 4], [1, 2], [1, 2, 3, 4, 8])
    if v == 1 or m % p == 0
]


@pytest.mark.parametrize(("p", "v", "m"), SHAPES)
def test_valid_at_1f1b_memory_with_less_bubble(p, v, m):
    schedule = zero_bubble(p * v, p, m)
    validate(schedule)
    validate(lower_communication(schedule))
    base = interleaved(p * v, p, m)
    assert max(peak_in_flight(schedule)) == max(peak_in_flight(base))
    zb, onef1b = simulate(schedule), simulate(base)
    assert zb.makespan <= onef1b.makespan
    if p > 1:
        assert zb.bubble_fraction < onef1b.bubble_fraction
    for actions in schedule.actions.values():
        kinds = {a.kind for a in actions}
        assert kinds <= {Kind.F, Kind.I, Kind.W}
        assert sum(a.kind == Kind.W for a in actions) == v * m
        done = set()
        for a in actions:  # every W after its own I
            if a.kind == Kind.W:
                assert (a.stage, Kind.I, a.microbatch) in done
            done.add((a.stage, a.kind, a.microbatch))


def test_zb_h1_bubble_p2_m4():
    # 1F1B with unit costs (F=1, I=1, W=1): makespan 15; ZB-H1 fills the cool-down with W.
    result = simulate(zero_bubble(2, 2, 4))
    assert result.makespan == 13
    assert str(zero_bubble(2, 2, 4)).splitlines()[1].split()[2:] == [
        "0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0F3", "0I2", "0W2", "0I3", "0W3",
    ]  # fmt: skip


def test_forward_only_and_sharding_lowering():
    assert all(a.kind == Kind.F for a in zero_bubble(4, 2, 4, forward_only=True).iter_actions())
    lowered = lower_sharding(zero_bubble(2, 2, 4), 3)
    rank0 = [str(a) for a in lowered.actions[0]]
    assert rank0.index("0REDUCE_GRAD") > rank0.index("0W3")  # reduced after the last W
    validate(lowered)


def test_registry_config_and_errors():
    assert "zero_bubble" in PIPELINES
    assert build_schedule("zero_bubble", 2, 4).name == "zero_bubble"
    with pytest.raises(ScheduleError, match="zero_bubble"):
        build_schedule("zb", 2, 4)
    assert load_config({"pipeline": "zero_bubble"}).pipeline == "zero_bubble"
    with pytest.raises(ConfigError, match="zero_bubble"):
        load_config({"pipeline": "zerobubble"})
    with pytest.raises(ConfigError, match="multiple of pipeline_parallel_degree"):
        load_config(
            {
                "pipeline": "zero_bubble",
                "pipeline_parallel_degree": 2,
                "virtual_stages": 2,
                "microbatches": 3,
            }
        )


@pytest.mark.parametrize(
    ("pipeline", "p", "v", "m"),
    [
        ("zero_bubble", 2, 1, 4),
        ("zero_bubble", 4, 2, 8),
        ("interleaved", 2, 2, 4),
        ("simple", 3, 1, 5),
    ],
)
def test_csv_round_trip(tmp_path, pipeline, p, v, m):
    schedule = build_schedule(pipeline, p, m, virtual_stages=v)
    path = tmp_path / "s.csv"
    write_csv(schedule, path)
    back = read_csv(path)
    assert back.actions == schedule.actions
    assert (back.num_ranks, back.virtual_stages, back.num_microbatches) == (p, v, m)
    assert build_schedule(str(path), p, m, virtual_stages=v).actions == schedule.actions
    forward = read_csv(path, forward_only=True)
    assert forward.is_forward_only and len(list(forward.iter_actions())) == p * v * m


def test_csv_in_torch_format_and_errors(tmp_path):
    # torch writes idle slots as empty cells; they are skipped
    text = "0F0,,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    schedule = schedule_from_csv(text)
    assert [str(a) for a in schedule.actions[1]] == ["1F0", "1B0", "1F1", "1B1"]
    assert schedule_to_csv(schedule) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    v_shaped = schedule_from_csv("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n")
    assert v_shaped.placement == "v"
    with pytest.raises(ScheduleError, match="follows neither"):
        schedule_from_csv("1F0,1B0\n0F0,0B0\n")
    with pytest.raises(ScheduleError, match="adds the sharding actions itself"):
        schedule_from_csv("0UNSHARD,0F0,0B0\n")
    with pytest.raises(ScheduleError, match="0SEND_F0 has no peer on another rank"):
        schedule_from_csv("0F0,0SEND_F0,0B0\n")
    with pytest.raises(ScheduleError, match="lacks 1RECV_F0"):  # transfers: all or none
        schedule_from_csv("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1B0,1SEND_B0\n")
    with pytest.raises(ScheduleError):
        schedule_from_csv("0F0\n1F0,1B0\n")  # 0B0 missing: validation names it
    with pytest.raises(ScheduleError, match="empty"):
        schedule_from_csv("\n")
    path = tmp_path / "zb.csv"
    write_csv(zero_bubble(2, 2, 4), path)
    cfg = load_config({"pipeline": str(path), "pipeline_parallel_degree": 2, "microbatches": 4})
    assert cfg.pipeline == str(path)
    with pytest.raises(ConfigError, match="microbatches"):
        load_config({"pipeline": str(path), "pipeline_parallel_degree": 2, "microbatches": 8})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"pipeline": str(tmp_path / "missing.csv")})


def test_cli_schedule_csv_export_and_import(tmp_path, capsys):
    from mpar.cli import main

    path = tmp_path / "zb.csv"
    assert main(["schedule", "--pipeline", "zero_bubble", "--stages", "2", "--microbatches", "4", "--csv", str(path)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["schedule", "--pipeline", str(path)]) == 0
    out = capsys.readouterr().out
    assert "from CSV" in out and "makespan 13" in out
    assert main(["schedule", "--pipeline", str(path), "--microbatches", "8"]) == 1
    assert "microbatches" in capsys.readouterr().err


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 1), (2, 4), (2, 8), (3, 7), (4, 8)])
def test_zbv_valid_v_placed_at_1f1b_memory(p, m):
    from mpar.schedule import zbv

    schedule = zbv(2 * p, p, m)
    assert schedule.placement == "v"
    assert [schedule.stages_of(r) for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]
    validate(schedule)
    validate(lower_communication(schedule))
    validate(lower_sharding(schedule, 3))
    assert max(peak_in_flight(schedule)) <= 2 * p  # p microbatches of two half-size chunks
    if p > 1:  # less bubble than 1F1B (against ZB-H1 it depends on p and m)
        assert simulate(schedule).bubble_fraction < simulate(interleaved(p, p, m)).bubble_fraction


def test_zbv_p2_m4_bubble_and_lowering_skips_same_rank_edges():
    from mpar.schedule import zbv

    assert simulate(zbv(4, 2, 4)).bubble_fraction == pytest.approx(1 / 25)
    lowered = [str(a) for a in lower_communication(zbv(4, 2, 1)).actions[1]]
    assert "1SEND_F0" not in lowered and "2RECV_F0" not in lowered  # stages 1, 2 share rank 1
    assert "1RECV_F0" in lowered and "2SEND_F0" in lowered


def test_zbv_errors_config_and_csv(tmp_path):
    from mpar.schedule import zbv

    with pytest.raises(ScheduleError, match="two stages"):
        zbv(6, 2, 4)
    with pytest.raises(ConfigError, match="virtual_stages to 2"):
        load_config({"pipeline": "zbv", "pipeline_parallel_degree": 2})
    assert load_config({"pipeline": "zbv", "virtual_stages": 2}).pipeline == "zbv"
    path = tmp_path / "zbv.csv"
    write_csv(zbv(4, 2, 4), path)
    back = read_csv(path)
    assert back.placement == "v" and back.actions == zbv(4, 2, 4).actions


def _costs(p, v, seed):
    import random

    from mpar.schedule import StageCosts

    rng = random.Random(seed)
    n = p * v
    forward = [rng.uniform(0.5, 2.0) for _ in range(n)]
    i_part = [0.0] + [rng.uniform(0.5, 2.0) for _ in range(n - 1)]  # stage 0: no input grad
    w_part = [rng.uniform(0.5, 2.0) + (2 * forward[0] if s == 0 else 0.0) for s in range(n)]
    backward = [a + b for a, b in zip(i_part, w_part)]
    return StageCosts(forward, backward, rng.uniform(0.0, 0.3), i_part, w_part)


@pytest.mark.parametrize(("p", "v", "m"), [s for s in SHAPES if s[0] > 1])
@pytest.mark.parametrize("allowance", [0, 1])
def test_a_placement_from_costs_is_valid_within_its_memory_and_not_slower(p, v, m, allowance):
    from mpar.schedule._zero_bubble import _steps_makespan

    costs = _costs(p, v, seed=p * 100 + v * 10 + m)
    unit = zero_bubble(p * v, p, m)
    k = max(peak_in_flight(unit)) + allowance
    placed = zero_bubble(p * v, p, m, active_microbatches=k if allowance else None, costs=costs)
    validate(placed)
    validate(lower_communication(placed))
    assert max(peak_in_flight(placed)) <= k
    assert _steps_makespan(placed, costs) <= 1.01 * _steps_makespan(unit, costs)
    for r, actions in placed.actions.items():  # the same F and I order as the unit placement
        same = [a for a in actions if a.kind != Kind.W]
        assert same == [a for a in unit.actions[r] if a.kind != Kind.W]


def test_a_heavier_last_stage_with_room_for_a_third_microbatch():
    """Issue 29's measured case (p=2, m=4, traced action times in ms): the unit costs cannot
    see that rank 0 runs ahead, so only a timed placement with an allowance gains."""
    from mpar.schedule import StageCosts
    from mpar.schedule._zero_bubble import _steps_makespan

    costs = StageCosts([7.4, 9.0], [14.0, 16.1], 0.5, [0.0, 9.5], [14.0, 6.6])
    unit = zero_bubble(2, 2, 4)
    assert zero_bubble(2, 2, 4, costs=costs).actions == unit.actions  # ZB-H1's memory: optimal
    placed = zero_bubble(2, 2, 4, active_microbatches=3, costs=costs)
    assert peak_in_flight(placed) == [2, 3]  # the allowance on the last stage only
    assert _steps_makespan(placed, costs) < 0.96 * _steps_makespan(unit, costs)
    assert placed.actions[0] == unit.actions[0]
    # the first W fills the wait for the third forward; the last three fill the next
    # step's start (benchmarks/schedules/p2_m4_last_stage_three_in_flight.csv)
    assert [str(a) for a in placed.actions[1]] == [
        "1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1F3", "1I3", "1W1", "1W2", "1W3",
    ]  # fmt: skip
    with pytest.raises(ScheduleError, match="costs cover 3 stages"):
        zero_bubble(2, 2, 4, costs=StageCosts([1, 1, 1], [2, 2, 2]))


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 4), (2, 1, 1), (3, 1, 6), (2, 2, 4), (4, 2, 8)])
def test_the_allowance_is_a_value_above_what_zb_h1_holds(p, v, m):
    """``zero_bubble_peak`` is what the uncapped schedule holds on its busiest rank;
    ``zero_bubble_allowance`` reads only a value above it as an allowance (the planner,
    the runtime's placement and the benchmark ask these, so they agree)."""
    peak = zero_bubble_peak(p, m, v)
    assert peak == max(peak_in_flight(zero_bubble(p * v, p, m)))
    assert peak == max(peak_in_flight(interleaved(p * v, p, m)))
    assert zero_bubble_allowance(p, m, v, None) is None
    assert zero_bubble_allowance(p, m, v, peak) is None
    assert zero_bubble_allowance(p, m, v, peak + 1) == peak + 1
    if peak > 1:  # a cap below the peak is a cap: the schedule holds that many
        assert zero_bubble_allowance(p, m, v, peak - 1) is None
