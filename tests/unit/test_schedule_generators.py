"""Schedule generators: golden grids, requirements and in-flight bounds."""

from __future__ import annotations

import pytest

from mpar.errors import ScheduleError
from mpar.schedule import (
    Kind,
    build_schedule,
    interleaved,
    peak_in_flight,
    render_text,
    simple,
    simulate,
    validate,
)

GOLDEN_SIMPLE_P2_M4 = """\
step   0   1   2   3   4   5   6   7
rank 0 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
rank 1 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"""

GOLDEN_INTERLEAVED_P2_M4 = """\
step   0   1   2   3   4   5   6   7
rank 0 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
rank 1 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"""

GOLDEN_INTERLEAVED_P2_M4_V2 = """\
step   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15
rank 0 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
rank 1 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"""

GOLDEN_SIMPLE_P2_M4_V2 = """\
step   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15
rank 0 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 0B0 0B1 0B2 0B3
rank 1 1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3 1B0 1B1 1B2 1B3"""

GOLDEN_TIMELINE_INTERLEAVED_P2_M4 = """\
time   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14
rank 0 0F0 0F1 .   .   0B0 ~~~ 0F2 0B1 ~~~ 0F3 0B2 ~~~ .   0B3 ~~~
rank 1 .   1F0 1B0 ~~~ 1F1 1B1 ~~~ 1F2 1B2 ~~~ 1F3 1B3 ~~~ .   ."""


@pytest.mark.parametrize(
    ("pipeline", "v", "golden"),
    [
        ("simple", 1, GOLDEN_SIMPLE_P2_M4),
        ("interleaved", 1, GOLDEN_INTERLEAVED_P2_M4),
        ("interleaved", 2, GOLDEN_INTERLEAVED_P2_M4_V2),
        ("simple", 2, GOLDEN_SIMPLE_P2_M4_V2),
    ],
)
def test_golden_grids(pipeline: str, v: int, golden: str) -> None:
    schedule = build_schedule(pipeline, 2, 4, virtual_stages=v)  # type: ignore[arg-type]
    assert str(schedule) == golden


def test_golden_timeline() -> None:
    result = simulate(build_schedule("interleaved", 2, 4))
    assert render_text(result) == GOLDEN_TIMELINE_INTERLEAVED_P2_M4


def test_generators_are_pure_functions() -> None:
    assert simple(4, 2, 3) == simple(4, 2, 3)
    assert interleaved(8, 4, 8) == build_schedule("interleaved", 4, 8, virtual_stages=2)


def test_interleaved_v2_needs_multiple_of_p() -> None:
    message = (
        "interleaved with 2 virtual stages needs microbatches to be a multiple of "
        "the pipeline degree 4 (got 6); use 4 or 8"
    )
    with pytest.raises(ScheduleError) as info:
        build_schedule("interleaved", 4, 6, virtual_stages=2)
    assert str(info.value) == message
    with pytest.raises(ScheduleError, match=r"\(got 3\); use 4$"):
        build_schedule("interleaved", 4, 3, virtual_stages=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline": "zigzag"}, "unknown pipeline 'zigzag'"),
        ({"num_ranks": 0}, "num_ranks must be a positive integer, got 0"),
        ({"num_microbatches": 0}, "num_microbatches must be a positive integer"),
        ({"virtual_stages": 0}, "virtual_stages must be a positive integer"),
        ({"active_microbatches": 0}, "active_microbatches must be a positive integer"),
        ({"virtual_stages": 2, "active_microbatches": 4}, r"needs active_microbatches >= 5"),
        ({"pipeline": "simple", "virtual_stages": 4, "active_microbatches": 3}, ">= 4"),
    ],
)
def test_build_schedule_errors(kwargs: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {
        "pipeline": "interleaved",
        "num_ranks": 4,
        "num_microbatches": 8,
    }
    arguments.update(kwargs)
    with pytest.raises(ScheduleError, match=match):
        build_schedule(**arguments)  # type: ignore[arg-type]


def test_stages_must_be_multiple_of_ranks() -> None:
    with pytest.raises(
        ScheduleError, match=r"num_stages \(6\) must be a multiple of num_ranks \(4\)"
    ):
        simple(6, 4, 8)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_peak_in_flight_v1(p: int, m: int) -> None:
    assert peak_in_flight(simple(p, p, m))[0] == m
    peaks = peak_in_flight(interleaved(p, p, m))
    assert peaks[0] == min(p, m)
    assert all(peak <= min(p - r, m) for r, peak in enumerate(peaks))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 4])
def test_peak_in_flight_interleaved_virtual(p: int, v: int) -> None:
    """v > 1: rank r holds at most min(v*m, (v+1)*p - 1 - 2*r) (stage, microbatch) pairs."""
    for m in (p, 2 * p, 4 * p):
        peaks = peak_in_flight(interleaved(v * p, p, m))
        assert peaks == [min(v * m, (v + 1) * p - 1 - 2 * r) for r in range(p)]
        assert peak_in_flight(simple(v * p, p, m))[0] == v * m


@pytest.mark.parametrize(("p", "v", "m"), [(4, 1, 8), (4, 1, 3), (4, 2, 8), (3, 4, 6), (1, 2, 5)])
@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_active_microbatches_cap(p: int, v: int, m: int, pipeline: str) -> None:
    least = v if pipeline == "simple" else (v - 1) * p + 1
    for k in range(least, v * m + 2):
        schedule = build_schedule(
            pipeline,  # type: ignore[arg-type]
            p,
            m,
            virtual_stages=v,
            active_microbatches=k,
        )
        result = simulate(schedule)
        assert max(result.peak_in_flight) <= k
        if k >= v * m:
            assert (
                result.peak_in_flight
                == simulate(
                    build_schedule(pipeline, p, m, virtual_stages=v)  # type: ignore[arg-type]
                ).peak_in_flight
            )


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize(("p", "v", "m"), [(1, 1, 1), (4, 1, 8), (4, 2, 8), (2, 4, 6)])
def test_forward_only(pipeline: str, p: int, v: int, m: int) -> None:
    schedule = build_schedule(pipeline, p, m, virtual_stages=v, forward_only=True)  # type: ignore[arg-type]
    validate(schedule)
    assert schedule.is_forward_only
    assert {a.kind for a in schedule.iter_actions()} == {Kind.F}
    result = simulate(schedule)
    assert result.peak_in_flight == (0,) * p
    assert result.makespan == (v - 1) * max(m, p) + m + p - 1
