"""The pipeline benchmark runs end to end (``--quick``: a tiny model, one 1F1B case
per framework, one repeat, plus mpar on a hand-placed schedule CSV) and writes its JSON
and markdown; peers that are not installed are reported as skipped, not failed; the
CSV's row stays out of the "best" ratios."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.slow  # 30-50 s; the pipeline transparency and zero-bubble tests cover the runtime
@pytest.mark.timeout(180)
def test_pipeline_benchmark_quick(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "pipeline.py"),
        "--quick",
        "--mpar-csv",
        str(ROOT / "benchmarks" / "schedules" / "p2_m4_last_stage_weights_last.csv"),
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "pipeline.json").read_text())
    hand_placed = [row for row in report["rows"] if row["split"] == "uniform (schedule CSV)"]
    assert len(hand_placed) == 1 and hand_placed[0]["status"] == "ok", hand_placed
    assert hand_placed[0]["schedule"].endswith("p2_m4_last_stage_weights_last.csv")
    assert hand_placed[0]["bound_ms"] > 0  # the CSV's own schedule, simulated
    rows = {row["framework"]: row for row in report["rows"] if row not in hand_placed}
    assert set(rows) == {"mpar", "torch", "deepspeed"}
    for framework, module in [("mpar", "mpar"), ("torch", "torch"), ("deepspeed", "deepspeed")]:
        row = rows[framework]
        if not _installed(module):
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
