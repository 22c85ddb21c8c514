"""``mpar schedule`` command line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpar.cli import _schedule


def test_prints_grid_bubble_and_peak(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--pipeline",
        "interleaved",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--virtual-stages",
        "2",
    ]
    assert _schedule.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "interleaved (1F1B): 4 ranks x 2 virtual stages = 8 stages, 8 microbatches"
    )
    assert "rank 3 .   .   .   3F0" in out
    assert "makespan 57 " in out
    assert "bubble fraction 0.1579 (15.79%)" in out
    assert "peak in-flight (stage, microbatch) pairs per rank: 11 9 7 5 (max 11)" in out


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _schedule.main(["--pipeline", "simple", "--stages", "2", "--microbatches", "4", "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["makespan"] == 15
    assert report["bubble_fraction"] == pytest.approx(0.2)
    assert report["peak_in_flight"] == [4, 4]
    # the executed schedule: transfers are actions of their own
    assert report["actions"]["1"][:4] == ["1RECV_F0", "1F0", "1RECV_F1", "1F1"]
    assert report["actions"]["0"][:3] == ["0F0", "0SEND_F0", "0F1"]


def test_prints_the_executed_actions_one_object_with_the_runtime(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mpar.schedule import executable_schedule

    argv = ["--pipeline", "zero_bubble", "--stages", "2", "--microbatches", "4"]
    assert _schedule.main([*argv, "--zero-stage", "3", "--actions"]) == 0
    out = capsys.readouterr().out
    executed = executable_schedule("zero_bubble", 2, 4, zero_stage=3)
    for rank in (0, 1):
        row = " ".join(str(a) for a in executed.actions[rank])
        assert f"rank {rank}: {row}" in out
    assert "0UNSHARD" in out and "0RECV_B3" in out and "0REDUCE_GRAD" in out
    assert _schedule.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plain = executable_schedule("zero_bubble", 2, 4)  # no ZeRO: transfers only
    assert report["actions"] == plain.to_dict()["actions"]


def test_csv_with_communication_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mpar.schedule import executable_schedule, read_csv

    path = tmp_path / "zbv.csv"
    argv = ["--pipeline", "zbv", "--stages", "2", "--microbatches", "4", "--virtual-stages", "2"]
    assert _schedule.main([*argv, "--csv", str(path), "--csv-communication"]) == 0
    capsys.readouterr()
    assert "RECV_B" in path.read_text()
    again = read_csv(path)
    assert again.placement == "v"
    assert again.actions == executable_schedule("zbv", 2, 4, virtual_stages=2).actions
    # and the file runs through mpar schedule as it is
    assert _schedule.main(["--pipeline", str(path), "--actions"]) == 0
    assert "rank 1: 1RECV_F0 1F0 " in capsys.readouterr().out


def test_zbv_header_names_zbv_not_a_csv(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--pipeline", "zbv", "--stages", "2", "--microbatches", "4", "--virtual-stages", "2"]
    assert _schedule.main(argv) == 0
    assert capsys.readouterr().out.startswith("zbv (ZBV): 2 ranks x 2 virtual stages")


def test_csv_communication_without_csv_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert _schedule.main(["--stages", "2", "--microbatches", "4", "--csv-communication"]) == 1
    assert "--csv-communication only applies with --csv" in capsys.readouterr().err


def test_csv_of_another_shape_names_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.csv"
    assert _schedule.main(["--stages", "2", "--microbatches", "2", "--csv", str(path)]) == 0
    capsys.readouterr()
    assert _schedule.main(["--pipeline", str(path), "--stages", "4"]) == 1
    err = capsys.readouterr().err  # before: "the config asks for 4 x 1 ... set
    assert "but --stages and --microbatches ask for 4 x 1 and 2; leave them out" in err
    assert "pipeline_parallel_degree" not in err  # pipeline_parallel_degree ..."


def test_active_microbatches_and_forward_only(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--stages", "4", "--microbatches", "8"]
    assert _schedule.main([*base, "--active-microbatches", "2", "--json"]) == 0
    assert max(json.loads(capsys.readouterr().out)["peak_in_flight"]) == 2
    assert _schedule.main([*base, "--forward-only"]) == 0
    assert "(1F1B, forward only)" in capsys.readouterr().out


def test_writes_png_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    argv = ["--stages", "2", "--microbatches", "2", "--png", str(png), "--trace", str(trace)]
    assert _schedule.main(argv) == 0
    assert png.stat().st_size > 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert f"wrote trace: {trace}" in capsys.readouterr().out


def test_impossible_combination_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--stages", "4", "--microbatches", "6", "--virtual-stages", "2"]
    assert _schedule.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "mpar schedule: error: interleaved with 2 virtual stages needs microbatches to be "
        "a multiple of the pipeline degree 4 (got 6); use 4 or 8\n"
    )


def test_zero_bubble_errors_name_zero_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    # before: "interleaved with 2 virtual stages needs ..." for --pipeline zero_bubble
    argv = ["--pipeline", "zero_bubble", "--stages", "2", "--microbatches", "3"]
    assert _schedule.main([*argv, "--virtual-stages", "2"]) == 1
    assert capsys.readouterr().err.startswith(
        "mpar schedule: error: zero_bubble with 2 virtual stages needs microbatches to be "
        "a multiple of the pipeline degree 2 (got 3); use 2 or 4"
    )
    argv = ["--pipeline", "zero_bubble", "--stages", "2", "--microbatches", "4"]
    assert _schedule.main([*argv, "--virtual-stages", "2", "--active-microbatches", "2"]) == 1
    assert "zero_bubble with 2 virtual stages needs active_microbatches >= 3" in (
        capsys.readouterr().err
    )


def test_bad_argument_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _schedule.main(["--stages", "0", "--microbatches", "2"])
    assert info.value.code == 2
    assert "argument --stages: must be a positive integer, got '0'" in capsys.readouterr().err


def test_unwritable_output_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing" / "t.json"
    assert _schedule.main(["--stages", "2", "--microbatches", "2", "--trace", str(target)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_registers_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="mpar")
    _schedule.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schedule", "--stages", "2", "--microbatches", "3"])
    assert args.run is _schedule.run
    assert (args.stages, args.microbatches, args.virtual_stages) == (2, 3, 1)


def test_trace_of_a_missing_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    missing = tmp_path / "runs" / "trace"
    assert _schedule.main(["--trace", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"--trace {str(missing)!r} is not an existing folder" in err
    assert "--stages and --microbatches" in err and "config key 'trace'" in err


def test_a_reader_that_stops_early_ends_it_without_a_traceback() -> None:
    """``mpar schedule ... | head``: the output (140 kB, more than a pipe holds) meets a
    closed pipe; the command stops with status 1 and nothing on stderr."""
    command = [sys.executable, "-m", "mpar", "schedule", "--pipeline", "interleaved"]
    command += ["--stages", "8", "--microbatches", "256", "--actions"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(100)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert stderr == "", stderr
