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
    simulate,
    validate,
    zero_bubble,
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
