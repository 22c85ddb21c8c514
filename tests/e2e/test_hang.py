"""No silent hangs: a rank that makes no progress is named, with its last action and stack.

Each job runs ``scripts/hang.py`` (a two-stage pipeline) under a launcher with a
small ``timeout_s``; the watchdog must end it non-zero within ``timeout_s`` + 30 s
with one report.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

_SUPPORT = Path(__file__).with_name("scripts") / "launch_support.py"
_spec = importlib.util.spec_from_file_location("mpar_hang_launch_support", _SUPPORT)
assert _spec is not None and _spec.loader is not None
support = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = support
_spec.loader.exec_module(support)

SCRIPT = str(support.SCRIPTS / "hang.py")
TIMEOUT_S = 6
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None
    or not (support.MPIEXEC.exists() or shutil.which("mpiexec")),
    reason="needs mpi4py and mpiexec",
)


def _check_sleeping_rank_named(result: support.Result, stuck: int = 1) -> None:
    assert result.returncode != 0, result.output
    assert result.seconds < TIMEOUT_S + 30, result.seconds
    summary = result.summary()
    assert summary, result.output
    assert summary[0].startswith(f"mpar launch: job failed: rank {stuck} "), result.output
    assert f"HangError: rank {stuck} made no progress for" in summary[0]
    assert "(step 1, action 1F0)" in summary[0]  # its last action
    report = result.stderr[result.stderr.index(f"mpar launch: traceback of rank {stuck}:") :]
    assert f"rank {stuck} (pid" in report and "step 1, action 1F0; last progress" in report
    assert f'File "{SCRIPT}", line' in report and "in train_step" in report
    assert "time.sleep(600)" in report  # its stack, through the user's step function
    assert "--- rank 0 ---" in report
    assert "waiting" in report and "for recv of gradients for 0B0 from rank 1" in report
    assert "last events (flight recorder, newest last):" in report


@pytest.mark.timeout(90)
def test_a_sleeping_rank_is_named_with_its_stack(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    result = support.launch(
        "--nproc-per-node",
        "2",
        SCRIPT,
        "sleep",
        "1",
        str(TIMEOUT_S),
        timeout=80,
        env_extra={"MPAR_TRACE": str(trace)},
    )
    _check_sleeping_rank_named(result)
    report = (trace / "hang-report.txt").read_text()
    assert "rank 1 made no progress" in report and "time.sleep(600)" in report
    for rank in (0, 1):
        record = json.loads((trace / f"rank{rank}.flight.json").read_text())
        assert record["rank"] == rank
        events = [e["event"] for e in record["events"]]
        assert f"{rank}F0" in events and "step begins" in events
        assert all(isinstance(e["time"], float) for e in record["events"])


@pytest.mark.timeout(90)
def test_an_extra_collective_on_one_rank_is_reported_not_hung() -> None:
    result = support.launch(
        "--nproc-per-node", "2", SCRIPT, "barrier", "0", str(TIMEOUT_S), timeout=80
    )
    assert result.returncode != 0, result.output
    assert result.seconds < TIMEOUT_S + 30, result.seconds
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 0 "), result.output
    assert "deadlock: rank 0 waits in barrier, which rank(s) 1 did not call" in summary[0]
    assert "rank 1 waits for recv of activations for 1F0 from rank 0" in summary[0]
    # both ranks' positions and rank 0's stack at its extra barrier
    assert "rank 0 (pid" in result.stderr and "rank 1 (pid" in result.stderr
    assert "mpar.barrier()  # only this rank" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_extra_torch_all_reduce_names_the_rank_inside_it() -> None:
    result = support.launch(
        "--nproc-per-node", "2", SCRIPT, "all_reduce", "0", str(TIMEOUT_S), timeout=80
    )
    assert result.returncode != 0, result.output
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 0 "), result.output
    assert "rank 0 made no progress" in summary[0]
    assert "between steps, after step 0, inside torch.distributed.all_reduce" in summary[0]
    assert "dist.all_reduce(torch.ones(1))" in result.stderr


@needs_mpi
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_a_sleeping_rank_is_named_under_mpi() -> None:
    result = support.launch(
        "--mpi", "--nproc-per-node", "2", SCRIPT, "sleep", "1", str(TIMEOUT_S), timeout=80
    )
    _check_sleeping_rank_named(result)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sleeping_rank_is_named_under_torchrun() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    cmd += [str(_free_port()), SCRIPT, "sleep", "1", str(TIMEOUT_S)]
    result = support.run(cmd, timeout=80)
    assert result.returncode != 0, result.output
    assert result.seconds < TIMEOUT_S + 30, result.seconds
    # the stuck rank prints the report, and torchrun repeats it from that rank's error file
    assert "rank 1 made no progress" in result.stderr
    assert "error_file" in result.stderr and "rank 1, the one that is behind" in result.stderr
    assert "time.sleep(600)" in result.stderr


def _free_port() -> int:
    from mpar.comm import free_port

    return free_port()
