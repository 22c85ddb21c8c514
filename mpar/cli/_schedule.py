"""``mpar schedule``: print, simulate and plot a pipeline schedule.

Example::

    mpar schedule --pipeline interleaved --stages 4 --microbatches 8 --virtual-stages 2 \\
        --png schedule.png --trace schedule.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mpar.errors import ScheduleError
from mpar.schedule import (
    PIPELINES,
    SCHEDULE_HELP,
    Schedule,
    SimulationResult,
    StageCosts,
    build_schedule,
    lower,
    read_csv,
    render_png,
    render_text,
    simulate,
    to_chrome_trace,
    write_csv,
)
from mpar.schedule._csv import is_csv_path
from mpar.schedule._measured import compare
from mpar.schedule._registry import check_csv_schedule

__all__ = ["add_parser", "main", "run"]

_DESCRIPTION = (
    "Build a pipeline schedule, print it as a rank x time grid and simulate it: "
    "makespan, bubble fraction (1 - busy / (ranks * makespan)) and peak in-flight "
    "(stage, microbatch) pairs per rank."
)


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``mpar schedule`` on an ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "schedule", help="print, simulate and plot a pipeline schedule", description=_DESCRIPTION
    )
    _add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_schedule_arguments(parser)
    _add_cost_arguments(parser)
    _add_output_arguments(parser)


def _add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline",
        type=_pipeline,
        default="interleaved",
        metavar="{" + ",".join(PIPELINES) + "} or FILE.csv",
        help="; ".join(f"{k} = {v}" for k, v in SCHEDULE_HELP.items())
        + "; or a schedule CSV in torch.distributed.pipelining's format, whose shape then "
        "comes from the file (default: %(default)s)",
    )
    parser.add_argument(
        "--stages",
        type=_positive_int,
        metavar="P",
        help="pipeline degree: number of ranks (total stages = P * V); required unless "
        "--pipeline is a CSV",
    )
    parser.add_argument("--microbatches", type=_positive_int, metavar="M")
    parser.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=1,
        metavar="V",
        help="stages (chunks) per rank (default: 1)",
    )
    parser.add_argument(
        "--active-microbatches",
        type=_positive_int,
        default=None,
        metavar="K",
        help="cap on (stage, microbatch) pairs in flight per rank",
    )
    parser.add_argument("--forward-only", action="store_true", help="forwards only (inference)")
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        metavar="Z",
        help="also lower the sharding actions (UNSHARD, RESHARD, REDUCE_GRAD) of ZeRO stage Z, "
        "as a run with data parallelism, ZeRO or mixed precision executes them",
    )
    parser.add_argument(
        "--actions",
        action="store_true",
        help="also print each rank's action list exactly as the runtime executes it "
        "(communication and sharding actions included)",
    )


def _add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--forward-cost",
        type=_cost,
        default=1.0,
        metavar="T",
        help="time of one forward per stage (default: 1)",
    )
    parser.add_argument(
        "--backward-cost",
        type=_cost,
        default=2.0,
        metavar="T",
        help="time of one backward per stage (default: 2)",
    )
    parser.add_argument(
        "--comm-cost",
        type=_cost,
        default=0.0,
        metavar="T",
        help="latency of one transfer between ranks (default: 0)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--png", type=Path, metavar="PATH", help="write a PNG timeline")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="write a Chrome trace JSON (open in https://ui.perfetto.dev); an existing "
        "directory that a run with the config key 'trace' wrote instead gives the measured "
        "timeline beside the simulated one (DIR/trace.json) and their step times and bubbles",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON report instead")
    parser.add_argument(
        "--csv",
        type=Path,
        metavar="PATH",
        help="write the schedule's compute actions as CSV (torch.distributed.pipelining's format)",
    )
    parser.add_argument(
        "--csv-communication",
        action="store_true",
        help="with --csv: also write the SEND/RECV actions, in the order the ranks execute "
        "them (a file mpar and torch.distributed.pipelining run as it is)",
    )


def _pipeline(text: str) -> str:
    if text in PIPELINES or is_csv_path(text):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown pipeline {text!r}: choose from {', '.join(PIPELINES)} or give a .csv file"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _measured(args: argparse.Namespace) -> int:
    """``--trace DIR`` of a run with ``trace``: measured beside simulated."""
    files = sorted(args.trace.glob("rank*.timeline.json"))
    if not files:
        raise ScheduleError(
            f"{str(args.trace)!r} holds no rank*.timeline.json: run with the config key "
            "'trace' (or MPAR_TRACE) set to this directory first"
        )
    comparison = compare([json.loads(f.read_text()) for f in files])
    out = args.trace / "trace.json"
    out.write_text(json.dumps(comparison.trace) + "\n")
    if args.json:
        report = {
            "step": comparison.step,
            "measured_step_s": comparison.measured_step_s,
            "simulated_step_s": comparison.simulated_step_s,
            "measured_bubble": comparison.bubble(True),
            "simulated_bubble": comparison.bubble(False),
            "overhead_us_per_action": {
                kind: {"actions": n, "median_us": us}
                for kind, (n, us) in comparison.overhead_us.items()
            },
            "trace": str(out),
        }
        print(json.dumps(report, indent=2))
    else:
        print(comparison.report())
        print(f"Perfetto trace (measured and simulated): {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``mpar schedule`` for parsed ``args``; returns the exit status."""
    try:
        if args.csv_communication and args.csv is None:
            raise ValueError("--csv-communication only applies with --csv PATH: add --csv out.csv")
        if args.trace is not None and args.trace.is_dir():
            return _measured(args)
        schedule, result = _build_and_simulate(args)
        if args.png is not None:
            render_png(result, args.png)
        if args.trace is not None:
            args.trace.write_text(json.dumps(to_chrome_trace(result)) + "\n")
        if args.csv is not None:
            write_csv(schedule, args.csv, communication=args.csv_communication)
    except (ScheduleError, ImportError, OSError, ValueError, KeyError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"mpar schedule: error: {first_line}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_json_report(args, schedule, result), indent=2))
    else:
        print(_text_report(args, schedule, result))
    return 0


def _build_and_simulate(args: argparse.Namespace) -> tuple[Schedule, SimulationResult]:
    if is_csv_path(args.pipeline):
        schedule = read_csv(args.pipeline, forward_only=args.forward_only)
        args.stages = args.stages or schedule.num_ranks
        args.microbatches = args.microbatches or schedule.num_microbatches
        check_csv_schedule(
            schedule,
            args.pipeline,
            args.stages,
            args.microbatches,
            schedule.virtual_stages,
            cli=True,
        )
    elif args.stages is None or args.microbatches is None:
        if args.trace is not None:  # a folder of measured timelines, misspelt or not made yet
            raise ScheduleError(
                f"--trace {str(args.trace)!r} is not an existing folder: give the folder a run "
                "with the config key 'trace' (or MPAR_TRACE) wrote its rank*.timeline.json "
                "into, or add --stages and --microbatches to write a simulated trace to that "
                "file"
            )
        raise ScheduleError("--stages and --microbatches are required (unless --pipeline is a CSV)")
    else:
        schedule = _generate(args)
    schedule = lower(schedule, zero_stage=args.zero_stage)  # what the ranks execute
    costs = StageCosts.uniform(
        schedule.num_stages,
        forward=args.forward_cost,
        backward=args.backward_cost,
        input_backward=args.backward_cost / 2,
        weight_backward=args.backward_cost / 2,
        comm=args.comm_cost,
    )
    return schedule, simulate(schedule, costs)


def _generate(args: argparse.Namespace) -> Schedule:
    return build_schedule(
        args.pipeline,
        args.stages,
        args.microbatches,
        virtual_stages=args.virtual_stages,
        active_microbatches=args.active_microbatches,
        forward_only=args.forward_only,
    )


def _text_report(args: argparse.Namespace, schedule: Schedule, result: SimulationResult) -> str:
    p, v, m = schedule.num_ranks, schedule.virtual_stages, schedule.num_microbatches
    kind = {"simple": "GPipe", "interleaved": "1F1B", "zero_bubble": "ZB-H1", "zbv": "ZBV"}.get(
        args.pipeline, "from CSV"
    )
    mode = ", forward only" if schedule.is_forward_only else ""
    peaks = " ".join(str(peak) for peak in result.peak_in_flight)
    lines = [
        f"{args.pipeline} ({kind}{mode}): {p} ranks x {v} virtual stage{'s' if v > 1 else ''} = "
        f"{schedule.num_stages} stages, {m} microbatches",
        render_text(result),
        f"makespan {result.makespan:g} (F={args.forward_cost:g}, B={args.backward_cost:g}, "
        f"comm={args.comm_cost:g} per stage)",
        f"bubble fraction {result.bubble_fraction:.4f} ({100 * result.bubble_fraction:.2f}%)",
        f"peak in-flight (stage, microbatch) pairs per rank: {peaks} "
        f"(max {max(result.peak_in_flight)})",
    ]
    if args.actions:
        lines.append("executed actions per rank:")
        lines += [
            f"rank {r}: {' '.join(str(a) for a in schedule.actions.get(r, []))}"
            for r in range(schedule.num_ranks)
        ]
    for label, path in (("png", args.png), ("trace", args.trace)):
        if path is not None:
            lines.append(f"wrote {label}: {path}")
    return "\n".join(lines)


def _json_report(
    args: argparse.Namespace, schedule: Schedule, result: SimulationResult
) -> dict[str, object]:
    report: dict[str, object] = {
        "pipeline": args.pipeline,
        "num_ranks": schedule.num_ranks,
        "virtual_stages": schedule.virtual_stages,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "active_microbatches": args.active_microbatches,
        "forward_only": schedule.is_forward_only,
        "actions": schedule.to_dict()["actions"],
    }
    report.update(result.to_dict())
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mpar schedule`` on its own (``argv`` without the word ``schedule``)."""
    parser = argparse.ArgumentParser(prog="mpar schedule", description=_DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
