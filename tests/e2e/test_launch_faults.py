"""Launcher faults: no orphans when ``mpar launch`` is killed; no silent hang at the
end of a job; the rank that never reached a collective, or left early, is named."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

_SUPPORT = Path(__file__).with_name("scripts") / "launch_support.py"
_spec = importlib.util.spec_from_file_location("mpar_fault_launch_support", _SUPPORT)
assert _spec is not None and _spec.loader is not None
support = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = support
_spec.loader.exec_module(support)

HANG = str(support.SCRIPTS / "hang.py")


@pytest.mark.timeout(120)
def test_sigkill_of_the_launcher_leaves_no_worker_after_15_s() -> None:
    token = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as tmp:
        files = (Path(tmp) / "out", Path(tmp) / "err")
        # rank 1 sleeps inside step 1, rank 0 waits for it: both alive, long timeout_s
        cmd = [sys.executable, "-m", "mpar.launch", "--nproc-per-node", "2", HANG, "sleep", "1"]
        launcher = support.start([*cmd, "300"], support.child_env(token), files)
        try:
            deadline = time.monotonic() + 90
            while len(support.rank_lines(files[0].read_text())) < 2:
                assert time.monotonic() < deadline, support.read(files)
                assert launcher.poll() is None, support.read(files)
                time.sleep(0.2)
            workers = [p for p in support.marked_pids(token) if p != launcher.pid]
            assert len(workers) >= 2, workers
            launcher.kill()  # SIGKILL: the launcher cannot stop anyone itself
            launcher.wait()
            killed = time.monotonic()
            while support.marked_pids(token) and time.monotonic() - killed < 15:
                time.sleep(0.2)
            left = support.marked_pids(token)
            assert not left, f"workers left 15 s after the launcher died: {left}"
        finally:
            support.kill_marked(token)


TIMEOUT_S = 8
END = str(support.SCRIPTS / "end_faults.py")


def _launch_end(how: str, rank: int, tmp_path: Path) -> support.Result:
    args = ["--nproc-per-node", "2", END, how, str(rank), str(TIMEOUT_S), str(tmp_path / "ck")]
    result = support.launch(*args, timeout=100)
    ended = time.time()
    assert result.returncode == 1, result.output  # the documented status of a failure
    last_step = max(float(f["at"]) for f in support.rank_lines(result.stdout).values())
    assert ended - last_step < TIMEOUT_S + 30, (ended - last_step, result.output)
    return result


@pytest.mark.timeout(120)
def test_a_rank_stuck_after_its_last_step_is_named_at_shutdown(tmp_path: Path) -> None:
    result = _launch_end("stuck", 1, tmp_path)
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 1 "), result.output
    assert "HangError: rank 1 made no progress" in summary[0], result.output
    assert "time.sleep(600)  # stuck after its last step" in result.stderr
    assert "barrier (in mpar.shutdown)" in result.stderr  # where the others wait


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_exits_early_is_named(tmp_path: Path) -> None:
    result = _launch_end("exit", 0, tmp_path)
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 0 "), result.output
    assert "rank 0 waits in barrier (in mpar.shutdown) (it reached the end" in summary[0]
    assert "_shutdown_at_exit" in result.stderr  # its stack: at exit, in mpar.shutdown


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_never_reaches_save_checkpoint_is_named(tmp_path: Path) -> None:
    result = _launch_end("skip_save", 1, tmp_path)
    summary = result.summary()
    assert summary[0].startswith("mpar launch: job failed: rank 1 "), result.output
    assert "HangError: rank 1 made no progress" in summary[0], result.output
    assert "time.sleep(600)  # never reaches the save" in result.stderr
    assert "DistStoreError" not in result.output


def test_an_exception_exits_1_even_when_its_rank_was_stopped_while_tearing_down() -> None:
    from mpar.launch._report import RankFailure, exit_status

    raised = RankFailure(rank=1, exitcode=-15, message="RuntimeError: boom", time=1.0)
    assert exit_status(raised) == 1  # was 143: the launcher's SIGTERM hit its teardown
    assert exit_status(RankFailure(rank=1, exitcode=-9)) == 137  # killed: 128 + signal
    assert exit_status(RankFailure(rank=1, exitcode=3, message="SystemExit: 3")) == 3


@pytest.mark.timeout(90)
def test_an_exception_in_a_step_exits_1() -> None:
    # before: 143 in 2 of 2 runs (the failing rank was stopped while tearing down)
    result = support.launch("--nproc-per-node", "2", str(support.SCRIPTS / "raise_in_step.py"), "1")
    assert result.returncode == 1, result.output
    assert result.summary()[0].endswith("raised RuntimeError: deliberate failure in the step")
