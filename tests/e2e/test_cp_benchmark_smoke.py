"""The context-parallel benchmark runs end to end (``--quick``: a tiny model, cp = 2,
one round of mpar's ring and all-to-all, the longest-sequence search at cp 1 and 2) and
writes its JSON and markdown; both methods train the same model as one process (same
warm-up losses), and the search finds a longest length for each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e._bench_smoke import run_quick


@pytest.mark.slow  # the default suite's context-parallel tests cover the runtime
@pytest.mark.timeout(600)
def test_cp_benchmark_quick(tmp_path: Path) -> None:
    engines = ["--engines", "mpar:ring", "mpar:all_to_all"]
    report: Any = run_quick("context_parallel", engines, tmp_path, timeout=590)
    rows = {row["engine"]: row for row in report["rows"]}
    assert set(rows) == {"mpar:ring", "mpar:all_to_all"}
    for row in rows.values():
        assert row["status"] == "ok", row.get("reason")
        assert row["tokens_per_s"] > 0 and row["peak_mib"] > 0
        assert row["agree"] and len(row["losses"]) == 2, row
    longest = {(r["engine"], r["cp"]): r for r in report["longest"]}
    assert set(longest) == {("one process", 1), ("mpar:ring", 2), ("mpar:all_to_all", 2)}
    assert all(r["status"] == "ok" and r["longest_seq"] > 0 for r in longest.values())
    table = (tmp_path / "context_parallel.md").read_text()
    assert "| mpar ring |" in table and "Longest sequence" in table
