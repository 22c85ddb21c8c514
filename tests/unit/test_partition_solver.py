"""The partition solver is optimal: it matches a brute force over contiguous splits."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpar.errors import PartitionError
from mpar.partition import (
    memory_weight_for,
    min_memory_for,
    min_stages_for,
    parameter_boundaries,
    solve,
    uniform_boundaries,
)


def _stage_cost(compute, memory, w, comm, s, e):
    total_c = sum(compute)
    total_m = sum(memory) if memory else 0.0
    cost = (1 - w) * sum(compute[s:e]) / total_c if total_c else 0.0
    if memory and total_m:
        cost += w * sum(memory[s:e]) / total_m
    if comm and e < len(compute) and total_c:
        cost += (1 - w) * comm[e - 1] / total_c
    return cost


def _brute(compute, k, memory=None, w=0.0, cap=None, comm=None):
    """Best bottleneck over all contiguous splits (None when nothing fits the cap)."""
    n = len(compute)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        starts = [0, *cuts]
        ends = [*cuts, n]
        if cap is not None and any(sum(memory[s:e]) > cap for s, e in zip(starts, ends)):
            continue
        top = max(_stage_cost(compute, memory, w, comm, s, e) for s, e in zip(starts, ends))
        best = top if best is None else min(best, top)
    return best


def _bottleneck(compute, starts, memory=None, w=0.0, comm=None):
    ends = [*starts[1:], len(compute)]
    return max(_stage_cost(compute, memory, w, comm, s, e) for s, e in zip(starts, ends))


costs = st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(costs, st.integers(1, 9))
def test_matches_brute_force(compute, k):
    k = min(k, len(compute))
    starts = solve(compute, k)
    assert starts[0] == 0 and len(starts) == k and starts == sorted(set(starts))
    assert _bottleneck(compute, starts) == pytest.approx(_brute(compute, k), rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 100), st.floats(0, 100), st.floats(0, 20)), min_size=1, max_size=8
    ),
    st.integers(1, 8),
    st.floats(0, 1),
    st.booleans(),
    st.floats(0.2, 1.5),
)
def test_matches_brute_force_with_memory_cap_and_comm(rows, k, w, use_comm, cap_scale):
    compute, memory, comm = (list(x) for x in zip(*rows))
    k = min(k, len(compute))
    comm_arg = comm if use_comm else None
    cap = cap_scale * sum(memory) / k
    expected = _brute(compute, k, memory, w, cap, comm_arg)
    if expected is None:
        with pytest.raises(PartitionError):
            solve(compute, k, memory=memory, memory_weight=w, memory_cap=cap, comm=comm_arg)
        return
    starts = solve(compute, k, memory=memory, memory_weight=w, memory_cap=cap, comm=comm_arg)
    ends = [*starts[1:], len(compute)]
    assert all(sum(memory[s:e]) <= cap for s, e in zip(starts, ends))
    got = _bottleneck(compute, starts, memory, w, comm_arg)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_large_input_is_fast():
    rng = random.Random(0)
    compute = [rng.uniform(0.1, 10) for _ in range(10_000)]
    start = time.perf_counter()
    starts = solve(compute, 64)
    elapsed = time.perf_counter() - start
    assert len(starts) == 64
    # Lower bound on the optimum: the average stage and the largest unit.
    lower = max(sum(compute) / 64, max(compute)) / sum(compute)
    assert _bottleneck(compute, starts) <= lower + max(compute) / sum(compute)
    assert elapsed < 5.0  # typically ~20 ms; benchmarks/partition_balance.py reports it


def test_no_fit_names_smallest_memory_and_degree():
    memory = [10.0] * 8
    with pytest.raises(PartitionError) as info:
        solve([1.0] * 8, 2, memory=memory, memory_cap=25.0)
    text = str(info.value)
    assert "40 B per stage" in text  # 2 stages need 4 units x 10 B each
    assert "smallest pipeline degree that fits is 4" in text
    assert min_memory_for(memory, 2) == 40.0
    assert min_stages_for(memory, 25.0) == 4


def test_no_fit_when_one_unit_is_too_big():
    with pytest.raises(PartitionError, match="'big' alone needs"):
        solve([1, 1, 1], 3, memory=[1, 50, 1], memory_cap=10, names=["a", "big", "c"])


@pytest.mark.parametrize(
    ("compute", "k"), [([], 1), ([1.0, 2.0], 3), ([1.0, -1.0], 1), ([1.0, math.nan], 1)]
)
def test_bad_input(compute, k):
    with pytest.raises(PartitionError):
        solve(compute, k)


def test_zero_costs_and_single_stage():
    assert solve([0.0, 0.0, 0.0], 3) == [0, 1, 2]
    assert solve([5.0, 1.0], 1) == [0]


def test_simple_methods():
    assert uniform_boundaries(10, 4) == [0, 3, 6, 8]
    assert parameter_boundaries([100, 1, 1, 1, 100], 2) in ([0, 2], [0, 3])
    with pytest.raises(PartitionError):
        uniform_boundaries(2, 3)


def test_memory_weight_defaults():
    assert memory_weight_for("speed") == 0.2
    assert memory_weight_for("memory") == 0.8
    assert memory_weight_for("speed", 0.5) == 0.5
    with pytest.raises(PartitionError):
        memory_weight_for("fast")
    with pytest.raises(PartitionError):
        memory_weight_for("speed", 1.5)


def test_subnormal_costs_do_not_overflow_the_normalisation():
    # found by hypothesis: 1 / 5e-324 overflows to inf and 0 * inf is nan
    assert solve([0.0, 5e-324], 1) == [0]
    assert solve([0.0, 5e-324], 2) == [0, 1]
    assert solve([5e-324] * 5, 3) == [0, 2, 4]
