"""The tensor-parallel benchmark runs end to end (``--quick``: a tiny TinyGPT, tp = 2,
one round of mpar and torch's DTensor TP) and writes its JSON and markdown; both
engines train the same model (same first losses as one process, same per-rank
parameter bytes, which are the counted ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e._bench_smoke import run_quick


@pytest.mark.slow  # 14 s; the default suite's TP grid covers the runtime
@pytest.mark.timeout(180)
def test_tp_benchmark_quick(tmp_path: Path) -> None:
    frameworks = ["--frameworks", "mpar", "torch"]
    report: Any = run_quick("tensor_parallel", frameworks, tmp_path, timeout=170)
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
