"""The expert-parallel benchmark runs end to end (``--quick``: a tiny MoE model on two
ranks, one round of mpar at ep = 2 and at ep = 1 with ZeRO-3) and writes its JSON and
markdown: both train the model as one process does, nothing is dropped, ep = 2 keeps
half the experts per rank and its all-to-alls send bytes (ep = 1 none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e._bench_smoke import run_quick


@pytest.mark.slow  # about 60 s on an idle 2-core machine
@pytest.mark.timeout(400)
def test_ep_benchmark_quick(tmp_path: Path) -> None:
    report: Any = run_quick("expert_parallel", ["--frameworks", "mpar"], tmp_path, timeout=390)
    assert (tmp_path / "expert_parallel.md").is_file()
    rows = {row["case"]: row for row in report["rows"]}
    ep2, ep1 = rows["mpar ep=2 zero3"], rows["mpar ep=1 zero3"]
    whole = report["meta"]["expert_bytes"]
    for row in (ep1, ep2):
        assert row["status"] == "ok", row.get("reason")
        assert row["losses_agree"] and row["dropped"] == 0
        assert row["expert_bytes"] == [whole // 2, whole // 2]  # ZeRO-3's shard; ep's half
    assert ep2["pairs_routed"] > 0  # every (token, expert) pair sent is received
    assert ep1["pairs_routed"] == 0  # ep = 1 keeps every expert local: no dispatch
    assert all(b > 0 for b in ep2["a2a_bytes_per_step"])
    assert ep1["a2a_bytes_per_step"] == [0, 0]
