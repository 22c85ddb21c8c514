"""``mpar launch`` end to end: layouts, --mpi, failure propagation, bad arguments."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest

from mpar.launch import main as launch_main
from mpar.launch._env import intra_op_threads
from mpar.launch._mpi import build_mpi_command
from mpar.launch._options import split_argv
from mpar.launch._report import RankFailure, choose_root, exit_status, format_report

_SUPPORT = Path(__file__).with_name("scripts") / "launch_support.py"
_spec = importlib.util.spec_from_file_location("mpar_launch_support", _SUPPORT)
assert _spec is not None and _spec.loader is not None
support = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = support  # dataclasses look their module up there
_spec.loader.exec_module(support)

SCRIPTS = support.SCRIPTS
CPUS = len(os.sched_getaffinity(0))


def _has_mpi() -> bool:
    return importlib.util.find_spec("mpi4py") is not None and (
        support.MPIEXEC.exists() or shutil.which("mpiexec") is not None
    )


needs_mpi = pytest.mark.skipif(not _has_mpi(), reason="needs mpi4py and mpiexec")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(tmp_path: Path, **entries: object) -> Path:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(entries))
    return path


# --- one node ---------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_four_processes_all_reduce_and_untouched_args() -> None:
    result = support.launch(
        "--nproc-per-node", "4", str(SCRIPTS / "allreduce.py"), "--nproc-per-node", "7", "two words"
    )
    assert result.returncode == 0, result.output
    ranks = support.rank_lines(result.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], result.output
    for fields in ranks.values():
        assert fields["world"] == "4"
        assert fields["sum"] == fields["expected"] == "10"
        assert fields["omp"] == str(intra_op_threads(CPUS, 4))
    assert result.stdout.count("args=['--nproc-per-node', '7', 'two words']") == 4


@pytest.mark.timeout(60)
def test_config_path_and_user_threads_reach_the_workers(tmp_path: Path) -> None:
    cfg = _config(tmp_path, microbatches=2)
    rel = os.path.relpath(cfg, support.REPO)
    result = support.launch(
        "--nproc-per-node",
        "2",
        "--config",
        rel,
        str(SCRIPTS / "show_env.py"),
        env_extra={"OMP_NUM_THREADS": "3"},
    )
    assert result.returncode == 0, result.output
    # one line per rank (a rank's line may still be glued to the other's: split at RANK=)
    lines = [c for c in re.split(r"(?=RANK=\d)", result.stdout) if c.startswith("RANK=")]
    assert len(lines) == 2, result.output
    for line in lines:
        assert "OMP_NUM_THREADS=3 " in line  # the user's setting wins
        assert f"MPAR_CONFIG={cfg} " in line  # absolute
        assert "MASTER_ADDR=127.0.0.1 " in line  # loopback rendezvous


# --- two launcher "nodes" on loopback ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_nodes_of_two_processes_on_loopback(tmp_path: Path) -> None:
    port, token = str(_free_port()), "two-nodes-" + os.urandom(6).hex()
    env = support.child_env(token)
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "mpar.launch",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "allreduce.py"),
        ]
        files = (tmp_path / f"out{node}", tmp_path / f"err{node}")
        procs.append((support.start(cmd, env, files), files))
    try:
        codes = [proc.wait(timeout=100) for proc, _ in procs]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        outputs = [support.read(files) for _, files in procs]
    assert codes == [0, 0], outputs
    ranks = {**support.rank_lines(outputs[0]), **support.rank_lines(outputs[1])}
    assert sorted(ranks) == [0, 1, 2, 3], outputs
    assert all(f["sum"] == "10" and f["world"] == "4" for f in ranks.values())
    assert sorted(support.rank_lines(outputs[1])) == [2, 3]  # node 1 holds ranks 2, 3
    support.assert_no_orphans(token, support.Result(0, *outputs, 0.0, token))


# --- MPI ----------------------------------------------------------------------------------------


@needs_mpi
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_mpi_four_processes(tmp_path: Path) -> None:
    cfg = _config(tmp_path, pipeline_parallel_degree=2)
    result = support.launch(
        "--mpi", "--nproc-per-node", "4", "--config", str(cfg), str(SCRIPTS / "mpi_ranks.py"), "x"
    )
    assert result.returncode == 0, result.output
    ranks = support.rank_lines(result.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], result.output
    for fields in ranks.values():
        assert fields["size"] == "4" and fields["sum"] == "10"
        assert fields["config"] == str(cfg)
        assert fields["omp"] == str(intra_op_threads(CPUS, 4))


# --- failures -----------------------------------------------------------------------------------

FAILURES = [
    pytest.param([], "fail.py", "raise", 2, id="elastic-exception"),
    pytest.param([], "fail.py", "kill", 1, id="elastic-sigkill"),
    pytest.param(["--mpi"], "mpi_ranks.py", "raise", 2, id="mpi-exception", marks=needs_mpi),
    pytest.param(["--mpi"], "mpi_ranks.py", "kill", 1, id="mpi-sigkill", marks=needs_mpi),
    pytest.param(
        ["--mpi"], "plain_fail.py", None, 1, id="mpi-exception-without-mpi-init", marks=needs_mpi
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "script", "how", "bad_rank"), FAILURES)
def test_failing_rank_stops_the_job(
    mode: list[str], script: str, how: str | None, bad_rank: int
) -> None:
    args = [how, str(bad_rank)] if how else [str(bad_rank)]
    result = support.launch(*mode, "--nproc-per-node", "4", str(SCRIPTS / script), *args)
    assert result.returncode != 0, result.output
    assert result.seconds < 30, result.seconds
    summary = result.summary()
    assert summary, result.output
    assert summary[0].startswith(f"mpar launch: job failed: rank {bad_rank} "), result.output
    if how == "kill":
        assert "SIGKILL" in summary[0]
        assert result.returncode == 128 + 9
    else:
        assert "raised" in summary[0] and "failure on rank" in summary[0]
        assert f"mpar launch: traceback of rank {bad_rank}:" in summary
        assert f'  File "{SCRIPTS / script}"' in result.stderr  # the rank's own frames
    # run() already checked that no process of the job is left


# --- bad arguments ------------------------------------------------------------------------------


def _launch_in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = launch_main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.timeout(30)
def test_missing_script_is_reported_by_the_command() -> None:
    result = support.launch("--nproc-per-node", "2", "no/such_script.py", timeout=30)
    assert result.returncode == 2
    assert "script 'no/such_script.py' not found" in result.stderr


@pytest.mark.timeout(10)
def test_no_script(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _launch_in_process(capsys, "--nproc-per-node", "2")
    assert code == 2 and "no script given" in err


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key", ["pipeline_parallel_degree", "partitions"])
def test_too_few_processes_for_the_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    cfg = _config(tmp_path, **{key: 4})
    code, err = _launch_in_process(
        capsys, "--nproc-per-node", "2", "--config", str(cfg), str(SCRIPTS / "allreduce.py")
    )
    assert code == 2
    assert f"{key}=4 but the job has only 2 processes" in err
    assert "--nproc-per-node 4" in err  # the fix


@pytest.mark.timeout(10)
def test_too_few_processes_for_a_yaml_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("partitions: 3\nmicrobatches: 4\n")
    code, err = _launch_in_process(
        capsys,
        "--mpi",
        "--nproc-per-node",
        "2",
        "--config",
        str(cfg),
        str(SCRIPTS / "mpi_ranks.py"),
    )
    assert code == 2 and "partitions=3" in err


@pytest.mark.timeout(10)
def test_busy_master_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, err = _launch_in_process(
            capsys,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            str(SCRIPTS / "allreduce.py"),
        )
    assert code == 2
    assert f"--master-port {port} is busy" in err
    suggested = int(err.split("e.g. --master-port ")[1].split()[0].rstrip(",)"))
    assert suggested != port


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is out of range"),
        (["--nnodes", "2"], "needs --master-addr"),
        (["--mpi", "--max-restarts", "1"], "cannot be used with --mpi"),
        (["--nproc-per-node", "0"], "must be at least 1"),
    ],
)
def test_bad_layouts(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, err = _launch_in_process(capsys, *argv, str(SCRIPTS / "allreduce.py"))
    assert code == 2 and message in err, err


# --- mpar.init() through the launcher -------------------------------------------------------


@pytest.mark.timeout(90)
def test_mpar_init_reads_the_launcher_layout() -> None:
    mpar = pytest.importorskip("mpar")
    if not hasattr(mpar, "init"):
        pytest.skip("mpar.init() is not there yet")
    result = support.launch("--nproc-per-node", "4", str(SCRIPTS / "mpar_init.py"))
    assert result.returncode == 0, result.output
    ranks = support.rank_lines(result.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], result.output
    assert all(f["pp_size"] == "2" and f["dp_size"] == "2" for f in ranks.values())


# --- pure pieces --------------------------------------------------------------------------------


def test_split_argv_stops_at_the_script() -> None:
    argv = ["--nproc-per-node", "2", "--mpi", "train.py", "--nproc-per-node", "9", "--", "x"]
    assert split_argv(argv) == (
        ["--nproc-per-node", "2", "--mpi"],
        "train.py",
        ["--nproc-per-node", "9", "--", "x"],
    )
    assert split_argv(["--config=c.json", "--", "-weird.py", "a"]) == (
        ["--config=c.json"],
        "-weird.py",
        ["a"],
    )


def test_threads_per_process() -> None:
    assert [intra_op_threads(8, n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_mpi_commands_per_flavor() -> None:
    program = ["python", "-u", "b.py", "s.py"]
    hydra = build_mpi_command(
        "mpiexec",
        "hydra",
        nprocs=8,
        per_node=4,
        hostfile="hf",
        export=["MPAR_CONFIG"],
        program=program,
    )
    assert hydra == ["mpiexec", "-n", "8", "-f", "hf", "-ppn", "4", "-genvall", *program]
    ompi = build_mpi_command(
        "mpirun",
        "openmpi",
        nprocs=4,
        per_node=4,
        hostfile=None,
        export=["MPAR_CONFIG", "OMP_NUM_THREADS"],
        program=program,
    )
    assert ompi == [
        "mpirun",
        "-n",
        "4",
        "--oversubscribe",
        "-x",
        "MPAR_CONFIG",
        "-x",
        "OMP_NUM_THREADS",
        *program,
    ]


def test_root_cause_prefers_a_killed_rank_over_its_peers_errors() -> None:
    peer = RankFailure(rank=0, exitcode=1, message="RuntimeError: Connection closed", time=1.0)
    killed = RankFailure(rank=3, exitcode=-9)
    stopped = RankFailure(rank=1, exitcode=-15)
    assert choose_root([stopped, peer, killed]) is killed
    assert choose_root([stopped, peer]) is peer
    assert exit_status(killed) == 137 and exit_status(peer) == 1
    report = format_report([stopped, peer, killed], launcher="L")
    assert report.splitlines()[0].startswith("L: job failed: rank 3 was killed by SIGKILL")
    assert "L: stopped the other ranks: 1" in report


def test_root_cause_prefers_an_exception_over_a_lost_peer_recorded_earlier() -> None:
    """Under load a peer's "connection closed" can be recorded before the exception that
    closed it (seen on the old-end job: rank 1 named instead of the raising rank 2)."""
    cause = RankFailure(rank=2, exitcode=1, message="RuntimeError: deliberate failure", time=2.0)
    gone = "RuntimeError: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [::1]:7"
    peer = RankFailure(rank=1, exitcode=1, message=gone, time=1.9)
    assert choose_root([peer, cause]) is cause
    assert choose_root([peer]) is peer  # alone, it is what there is to say
    killed = RankFailure(rank=3, exitcode=-9)
    assert choose_root([peer, cause, killed]) is killed


def test_after_a_hang_report_the_quietly_exiting_ranks_are_stopped_not_failed() -> None:
    hang = RankFailure(rank=1, exitcode=1, message="HangError: rank 1 made no progress", time=2.0)
    quiet = RankFailure(rank=0, exitcode=1)
    report = format_report([quiet, hang], launcher="L")
    assert (
        report.splitlines()[0] == "L: job failed: rank 1 raised HangError: rank 1 made no progress"
    )
    assert "L: stopped the other ranks: 0" in report and "also" not in report
    # the hang report explains a rank killed later (here: stopped, then SIGKILLed at the end)
    assert choose_root([RankFailure(rank=0, exitcode=-9), hang]) is hang
    # without a hang report, a rank that exits 1 is a failure of its own
    assert "L: also: rank 0 exited with code 1" in format_report(
        [quiet, RankFailure(rank=1, exitcode=1, message="RuntimeError: x", time=2.0)],
        launcher="L",
    )


def test_cli_registers_the_launch_subcommand() -> None:
    from mpar.cli import _launch

    parser = argparse.ArgumentParser(prog="mpar")
    _launch.add_parser(parser.add_subparsers(dest="command"))
    assert "launch" in parser.format_help()
    args = parser.parse_args(["launch", "--nproc-per-node", "2", "t.py", "--lr", "1"])
    assert args.argv == ["--nproc-per-node", "2", "t.py", "--lr", "1"]
    assert args.run is _launch.run


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node" in out and "--mpi" in out and "script.py" in out


@pytest.mark.timeout(120)
def test_a_script_that_never_calls_shutdown_exits_cleanly() -> None:
    """Without ``mpar.shutdown()`` the gloo process group's threads outlived the
    interpreter and the ranks aborted at exit (SIGABRT, "terminate called without an
    active exception") in 3 of 5 runs; ``mpar.init`` now registers the shutdown."""
    for _ in range(2):
        result = support.launch("--nproc-per-node", "4", str(SCRIPTS / "no_shutdown.py"))
        assert result.returncode == 0, result.output
        assert "terminate called" not in result.output, result.output
        assert sorted(support.rank_lines(result.stdout)) == [0, 1, 2, 3], result.output


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--nproc-per-node", "abc", "must be a whole number, got 'abc'"),
        ("--nproc-per-node", "0", "must be at least 1, got 0"),
        ("--max-restarts", "two", "must be a whole number, got 'two'"),
    ],
)
def test_a_bad_count_is_named(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    """(A word was 'invalid _positive_int value: 'abc'', the parser's function name.)"""
    code, err = _launch_in_process(capsys, flag, value, str(SCRIPTS / "allreduce.py"))
    assert code == 2 and f"argument {flag}" in err and message in err


@pytest.mark.timeout(10)
def test_a_scripts_bad_command_line_reads_as_such_in_the_failure_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the launcher's summary said only 'raised SystemExit: 2' for a script
    given a bad flag (train_gpt.py --steps abc), the reason buried above among every
    rank's output; now argparse's message follows."""
    from mpar.launch import _child

    recorded: list[tuple[str, str]] = []
    monkeypatch.setattr(_child, "record_failure", lambda m, t: recorded.append((m, t)))
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--steps", type=int)
    with pytest.raises(SystemExit) as bad:
        parser.parse_args(["--steps", "abc"])
    _child._report_failure(bad.value, "train.py")
    message, text = recorded[0]
    assert message == (
        "SystemExit: 2 (train.py: error: argument --steps: invalid int value: 'abc')"
    )
    assert text == message + "\n"
    _child._report_failure(SystemExit(3), "train.py")  # sys.exit(3): the code alone
    assert recorded[1] == ("SystemExit: 3", "SystemExit: 3\n")
