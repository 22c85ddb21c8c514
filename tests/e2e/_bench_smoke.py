"""What the benchmark smoke tests share: run one benchmark script with ``--quick`` and
read back the JSON report it wrote."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "installed", "run_quick"]

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, args: list[str], out: Path, timeout: float) -> dict[str, object]:
    """Run ``benchmarks/<script>.py --quick <args> --out <out>`` from the repository root;
    fail with the tail of its output unless it exits 0; return ``out/<script>.json``."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", *args]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, object] = json.loads((out / f"{script}.json").read_text())
    return report


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (a peer the benchmark skips otherwise)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
