"""Renderers: text grid, Chrome trace JSON, PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpar.schedule import (
    StageCosts,
    build_schedule,
    render_png,
    render_text,
    simulate,
    to_chrome_trace,
)


def test_render_text_of_schedule_is_its_grid() -> None:
    schedule = build_schedule("simple", 2, 2)
    assert render_text(schedule) == str(schedule)


def test_render_text_time_unit() -> None:
    costs = StageCosts.uniform(2, forward=0.5, backward=1.0)
    result = simulate(build_schedule("simple", 2, 1), costs)
    assert render_text(result) == (
        "time   0   1   2   3   4   5\nrank 0 0F0 .   .   .   0B0 ~~~\nrank 1 .   1F0 1B0 ~~~ .   ."
    )
    assert render_text(result, time_unit=1.0).splitlines()[0] == "time   0   1   2"


def test_chrome_trace() -> None:
    result = simulate(build_schedule("interleaved", 2, 2, virtual_stages=2))
    trace = json.loads(json.dumps(to_chrome_trace(result)))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * 4 * 2
    first = next(e for e in events if e["name"] == "1F0")
    assert (first["tid"], first["ts"], first["dur"], first["cat"]) == (1, 1000.0, 1000.0, "F")
    assert first["args"] == {"stage": 1, "chunk": 0, "microbatch": 0}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}


def test_render_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = simulate(build_schedule("interleaved", 2, 4, virtual_stages=2))
    path = render_png(result, tmp_path / "schedule.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_png_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = simulate(build_schedule("simple", 1, 1))
    with pytest.raises(ImportError, match=r"render_png needs matplotlib.*pip install"):
        render_png(result, tmp_path / "x.png")
