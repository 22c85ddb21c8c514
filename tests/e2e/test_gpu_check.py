"""The GPU check (``benchmarks/gpu/check.py``) in its reduced CPU mode: every part starts
and the CPU parts work — the offline install, the CUDA tests' collection (they skip
without a GPU), ZeRO-3 training with optimizer offload, and pp=1 against eager."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_gpu_check_cpu_mode(tmp_path: Path) -> None:
    cmd = [str(ROOT / "benchmarks" / "gpu" / "check.sh"), "--cpu", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=590, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "check_cpu.json").read_text())
    assert report["mode"] == "cpu" and report["ok"]
    assert report["install"]["ok"], report["install"]
    assert report["tests"]["counts"].get("skipped", 0) >= 3  # collected, no GPU here
    assert "failed" not in report["tests"]["counts"]
    assert report["dependencies"]["ok"] and report["train_plain"]["ok"]
    assert report["train_plain"]["profile"]["attention_backend"] is not None
    train = report["train_offload"]
    assert train["ok"] and train["step_tokens_per_s"] > 0 and train["compute_mfu"] is None
    assert train["steady_tokens_per_s"] > 0 and train["steady_mfu"] is None  # back to back
    assert set(report["targets"]) >= {"offload_steady_mfu_ratio", "offload_m16_steady_mfu_ratio"}
    assert train["params"] > 0 and train["memory"]["cpu"]["optimizer"] > 0
    assert all(math.isfinite(v) for v in train["losses"])
    assert train["losses"][-1] < train["losses"][0]  # one batch, trained on: the loss falls
    assert train["syncs"]["ledger"].get("offload copies", 0) >= 1  # counted by reason
    sanity = report["sanity"]
    assert sanity["ok"] and sanity["max_param_diff"] <= 1e-5
    assert len(sanity["losses"]["mpar"]) == len(sanity["losses"]["eager"]) == 3
    assert "tokens/s" in proc.stdout and "gpu check: passed" in proc.stdout


def test_the_debug_modes_own_notice_is_not_counted_as_a_sync() -> None:
    """torch warns once per process when the sync debug mode is first set ("...is a
    prototype feature..."): the check's count leaves that notice out."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        from probes import NOTICE, _is_sync
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "gpu"))
    assert not _is_sync(NOTICE + " and does not yet detect all synchronizing operations")
    assert _is_sync("called a synchronizing CUDA operation")
