"""mpar.init under real launchers: torchrun and mpiexec (from the `mpi` extra)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpar.comm import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, torch, mpar
from mpar.comm._collectives import all_reduce_dp
mpar.init({"pipeline_parallel_degree": 2})
value = torch.tensor([float(mpar.rank())])
st = mpar.comm.state()
all_reduce_dp(value, st.grid)
out = open(f"result{mpar.rank()}.json", "w")
out.write(json.dumps({"rank": mpar.rank(), "pp_size": mpar.pp_size(),
      "dp_size": mpar.dp_size(), "grid": st.grid.topology.pp_groups, "sum": value.item(),
      "dp_ranks": st.grid.dp_ranks, "source": st.layout.source}))
out.close()
mpar.shutdown()
"""


def _results(folder: Path) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in folder.glob("result*.json")]
    return sorted(rows, key=lambda r: r["rank"])


def _check(rows: list[dict], source: str) -> None:
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert len({json.dumps(r["grid"]) for r in rows}) == 1
    for r in rows:
        assert (r["pp_size"], r["dp_size"], r["source"]) == (2, 2, source)
        assert r["sum"] == float(sum(r["dp_ranks"]))


def _run(cmd: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(150)
def test_torchrun_four_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    _run(
        torchrun + ["--nproc-per-node", "4", "--master-port", str(free_port()), str(script)],
        tmp_path,
    )
    _check(_results(tmp_path), "torchrun")


def _mpiexec() -> str | None:
    local = Path(sys.executable).with_name("mpiexec")
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_mpiexec_four_processes(tmp_path):
    pytest.importorskip("mpi4py")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (install mpar[mpi])")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    _run([mpiexec, "-n", "4", sys.executable, str(script)], tmp_path)
    _check(_results(tmp_path), "mpi")
