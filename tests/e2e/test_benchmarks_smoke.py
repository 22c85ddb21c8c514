"""The pipeline benchmark runs end to end (``--quick``: a tiny model, one 1F1B case
per framework, one repeat, plus mpar on a hand-placed schedule CSV) and writes its JSON
and markdown; peers that are not installed are reported as skipped, not failed; the
CSV's row stays out of the "best" ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e._bench_smoke import ROOT, installed, run_quick


@pytest.mark.slow  # 30-50 s; the pipeline transparency and zero-bubble tests cover the runtime
@pytest.mark.timeout(180)
def test_pipeline_benchmark_quick(tmp_path: Path) -> None:
    csv = ROOT / "benchmarks" / "schedules" / "p2_m4_last_stage_weights_last.csv"
    report: Any = run_quick("pipeline", ["--mpar-csv", str(csv)], tmp_path, timeout=170)
    hand_placed = [row for row in report["rows"] if row["split"] == "uniform (schedule CSV)"]
    assert len(hand_placed) == 1 and hand_placed[0]["status"] == "ok", hand_placed
    assert hand_placed[0]["schedule"].endswith("p2_m4_last_stage_weights_last.csv")
    assert hand_placed[0]["bound_ms"] > 0  # the CSV's own schedule, simulated
    rows = {row["framework"]: row for row in report["rows"] if row not in hand_placed}
    assert set(rows) == {"mpar", "torch", "deepspeed"}
    for framework, module in [("mpar", "mpar"), ("torch", "torch"), ("deepspeed", "deepspeed")]:
        row = rows[framework]
        if not installed(module):
            assert row["status"] == "skipped", row
            continue
        assert row["status"] == "ok", row.get("reason")
        assert row["samples_per_s"] > 0 and row["bound_ms"] > 0
        assert row["stage_layers"] == [2, 2]  # the same uniform split everywhere
    assert any(r["peer"].startswith("torch") for r in report["ratios"])
    assert not any(".csv" in r["mpar"] for r in report["ratios"])
    assert not any(".csv" in best for r in report["round_ratios"] for best in r["round_best"])
    assert report["round_ratios"] and all(r["bound_ratio"] > 0 for r in report["round_ratios"])
    table = (tmp_path / "pipeline.md").read_text()
    assert "| mpar |" in table and "mpar / peer" in table
