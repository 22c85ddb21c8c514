"""No silent hangs: a rank that makes no progress is named, with its last action and stack.

Each job runs ``scripts/hang.py`` (a two-stage pipeline) under a launcher with a
small ``timeout_s``; the watchdog must end it non-zero within ``timeout_s`` + 30 s
of the stall (the first step completes before it), with one report.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

_SUPPORT = Path(__file__).with_name("scripts") / "launch_support.py"
_spec = importlib.util.spec_from_file_location("mpar_hang_launch_support", _SUPPORT)
assert _spec is not None and _spec.loader is not None
support = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = support
_spec.loader.exec_module(support)

SCRIPT = str(support.SCRIPTS / "hang.py")
TIMEOUT_S = 8  # the first step profiles and partitions: keep above that on a busy machine
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None
    or not (support.MPIEXEC.exists() or shutil.which("mpiexec")),
    reason="needs mpi4py and mpiexec",
)
MPI = pytest.param(["--mpi"], id="mpi", marks=[needs_mpi, pytest.mark.mpi])


def _launch(mode: list[str], how: str, rank: int, **kwargs: object) -> support.Result:
    args = [*mode, "--nproc-per-node", "2", SCRIPT, how, str(rank), str(TIMEOUT_S)]
    return support.launch(*args, timeout=100, **kwargs)


def _check_ended_in_time(result: support.Result) -> None:
    """Non-zero, and within timeout_s + 30 s of the last rank finishing step 0."""
    ended = time.time()
    assert result.returncode != 0, result.output
    finished_step_0 = [float(f["at"]) for f in support.rank_lines(result.stdout).values()]
    assert len(finished_step_0) == 2, result.output
    stalled = max(finished_step_0)
    assert ended - stalled < TIMEOUT_S + 30, (ended - stalled, result.output)


def _check_sleeping_rank_named(result: support.Result) -> None:
    _check_ended_in_time(result)
    summary = result.summary()
    assert summary, result.output
    assert summary[0].startswith("mpar launch: job failed: rank 1 "), result.output
    assert "HangError: rank 1 made no progress for" in summary[0]
    assert "(step 1, action 1F0)" in summary[0]  # its last action
    report = result.stderr[result.stderr.index("mpar launch: traceback of rank 1:") :]
    assert "rank 1 (pid" in report and "step 1, action 1F0; last progress" in report
    assert f'File "{SCRIPT}", line' in report and "in train_step" in report
    assert "time.sleep(600)" in report  # its stack, through the user's step function
    assert "--- rank 0 ---" in report
    assert "waiting" in report and "for recv of gradients for 0B0 from rank 1" in report
    assert "last events (flight recorder, newest last):" in report


@pytest.mark.timeout(120)
def test_a_sleeping_rank_is_named_with_its_stack(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    result = _launch([], "sleep", 1, env_extra={"MPAR_TRACE": str(trace)})
    _check_sleeping_rank_named(result)
    report = (trace / "hang-report.txt").read_text()
    assert "rank 1 made no progress" in report and "time.sleep(600)" in report
    for rank in (0, 1):
        record = json.loads((trace / f"rank{rank}.flight.json").read_text())
        assert record["rank"] == rank
        events = [e["event"] for e in record["events"]]
        assert f"{rank}F0" in events and "step begins" in events
        assert all(isinstance(e["time"], float) for e in record["events"])


@needs_mpi
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sleeping_rank_is_named_under_mpi() -> None:
    _check_sleeping_rank_named(_launch(["--mpi"], "sleep", 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [pytest.param([], id="mpar-launch", marks=pytest.mark.slow), MPI])
def test_an_extra_collective_on_one_rank_is_reported_not_hung(mode: list[str]) -> None:
    result = _launch(mode, "barrier", 0)
    _check_ended_in_time(result)
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 0 "), result.output
    assert "deadlock: rank 0 waits in barrier, which rank(s) 1 did not call" in summary[0]
    assert "rank 1 waits for recv of activations for 1F0 from rank 0" in summary[0]
    # both ranks' positions, and rank 0's stack at its extra barrier
    report = result.stderr[result.stderr.index("mpar launch: traceback of rank 0:") :]
    assert "rank 0 (pid" in report and "rank 1 (pid" in report
    assert "mpar.barrier()  # only this rank" in report


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_extra_torch_all_reduce_names_the_rank_inside_it() -> None:
    result = _launch([], "all_reduce", 0)
    _check_ended_in_time(result)
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 0 "), result.output
    assert "rank 0 made no progress" in summary[0]
    assert "between steps, after step 0, inside torch.distributed.all_reduce" in summary[0]
    assert "dist.all_reduce(torch.ones(1))" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sleeping_rank_is_named_under_torchrun() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    cmd += [str(_free_port()), SCRIPT, "sleep", "1", str(TIMEOUT_S)]
    result = support.run(cmd, timeout=100)
    _check_ended_in_time(result)
    # the stuck rank prints the report, and torchrun repeats it from that rank's error file
    assert "rank 1 made no progress" in result.stderr
    assert "error_file" in result.stderr and "rank 1, the one that is behind" in result.stderr
    assert "time.sleep(600)" in result.stderr


def _free_port() -> int:
    from mpar.comm import free_port

    return free_port()
