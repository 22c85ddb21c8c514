"""The tensor-parallel benchmark runs end to end (``--quick``: a tiny TinyGPT, tp = 2,
one round of mpar and torch's DTensor TP) and writes its JSON and markdown; both
engines train the same model (same first losses as one process, same per-rank
parameter bytes, which are the counted ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 14 s; the default suite's TP grid covers the runtime
@pytest.mark.timeout(180)
def test_tp_benchmark_quick(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "tensor_parallel.py"),
        "--quick",
        "--frameworks",
        "mpar",
        "torch",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "tensor_parallel.json").read_text())
    rows = {row["framework"]: row for row in report["rows"]}
    assert set(rows) == {"mpar", "torch"}
    expected = report["meta"]["expected_local_parameter_bytes"]
    for row in rows.values():
        assert row["status"] == "ok", row.get("reason")
        assert row["samples_per_s"] > 0
        assert [m["parameters"] for m in row["per_rank"]] == [expected, expected]
        assert all(m["rss_peak_bytes"] > 0 for m in row["per_rank"])
    assert [r["peer"] for r in report["ratios"]] == ["torch"]
    sanity = {c["framework"]: c for c in report["sanity"]}
    assert set(sanity) == {"mpar", "torch"}
    assert all(c["agree"] and len(c["losses"]) == 2 for c in sanity.values()), sanity
    table = (tmp_path / "tensor_parallel.md").read_text()
    assert "| mpar |" in table and "mpar / peer" in table
