"""The README's main job, shortened: 4 ranks (pp=2, dp=2) under mpar launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_gpt_example_trains_under_mpar_launch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [
        sys.executable,
        "-m",
        "mpar.launch",
        "--nproc-per-node",
        "4",
        "--config",
        str(ROOT / "examples/configs/gpt_pp2_dp2.json"),
        str(ROOT / "examples/train_gpt.py"),
        "--steps",
        "20",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "pp=2 dp=2" in out
    assert "pipeline plan: 2 ranks" in out
    losses = [float(x) for x in re.findall(r"loss\s+([0-9.]+)", out)]
    assert losses and losses[-1] < 1.0, out[-2000:]  # it learns the counting task
