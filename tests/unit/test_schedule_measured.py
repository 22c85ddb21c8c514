"""The runtime's overhead per action kind, from timeline entries (``mpar schedule --trace``)."""

from __future__ import annotations

import pytest

from mpar.schedule._measured import _split, overhead_by_kind


def test_overhead_is_the_action_less_its_compute_and_its_wait() -> None:
    # [text, start, end, waited, computed]
    forward = ["0F0", 10.0, 10.010, 0.0, 0.009]
    receive = ["1RECV_F0", 10.0, 10.004, 0.003, 0.0]
    assert _split(forward) == pytest.approx((0.009, 0.0, 0.001))
    assert _split(receive) == pytest.approx((0.0, 0.003, 0.001))
    got = overhead_by_kind([[forward, ["0F1", 11.0, 11.004, 0.0, 0.001]], [receive]])
    assert got["F"] == (2, pytest.approx(2000.0))  # the median of 1000 and 3000 µs
    assert got["RECV_F"] == (1, pytest.approx(1000.0))


def test_files_without_computed_seconds_count_compute_actions_as_compute() -> None:
    # timelines written before the runtime recorded its compute separately
    assert _split(["0B0", 1.0, 1.5, 0.1]) == pytest.approx((0.4, 0.1, 0.0))
    assert _split(["0SEND_F0", 1.0, 1.5, 0.0]) == pytest.approx((0.0, 0.0, 0.5))
    assert _split(["0F0", 1.0, 1.5]) == pytest.approx((0.5, 0.0, 0.0))
