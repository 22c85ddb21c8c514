"""Pipeline-parallel training throughput: mpar against its peers, on CPU/gloo.

One GPT-style model written as a list of layers (embedding, ``--layers``
transformer blocks, final norm + LM head; ``benchmarks/_common.py``) is trained
with SGD on the same fixed batch, the same microbatches and one intra-op thread
per rank by

* mpar: ``pipeline`` ``simple`` (GPipe), ``interleaved`` (1F1B), and
  ``interleaved`` with ``virtual_stages=2``, ``zero_bubble`` (ZB-H1) with 1 and
  2 virtual stages; started with ``mpar launch``;
* torch.distributed.pipelining: ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (2 stages per
  rank, looped) and ``ScheduleZBVZeroBubble`` (2 stages per rank in a V);
  started with ``torchrun``;
* DeepSpeed: ``PipelineModule`` + ``engine.train_batch()`` (its 1F1B
  ``TrainSchedule``) on the CPU accelerator; started with ``torchrun``.

Every framework gets the same split of the layers: equal layer counts per stage
(DeepSpeed's ``partition_method="uniform"``; mpar places it with
``mpar.partition(i)``, torch gets ``PipelineStage``s of the same slices).
``--auto`` adds mpar with its own profile-driven partition.

Each case runs in its own processes, ``--warmup`` untimed steps then
``--steps`` timed steps between barriers; the cases are run ``--repeats``
times, round-robin, and the median samples/s is reported. The bound is the
step time that ``mpar.schedule.simulate`` gives for the schedule with
per-layer forward/backward costs measured in this process, summed over each
stage of the split the run used (plus the slowest rank's optimizer step):
efficiency = bound / measured step time (``_bound.py``).

    python benchmarks/pipeline.py                      # pp=2, writes benchmarks/results/
    python benchmarks/pipeline.py --layouts 2x1 4x1 2x2 --repeats 5
    python benchmarks/pipeline.py --quick --out /tmp/b  # smoke run, seconds

``--overhead`` runs only mpar, with ``trace`` on, and reports the runtime's own
cost per action kind (µs per action outside the stage's computation and the
waits for peers: packing, sending, bookkeeping, hooks, the timeline; see
``mpar.schedule._measured``) to ``executor_overhead.{json,md}``:

    python benchmarks/pipeline.py --overhead --seq 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import BACKEND, MEASURED, Case, ModelSpec  # noqa: E402
from _harness import launch_job, missing_module  # noqa: E402

from mpar.schedule._csv import is_csv_path  # noqa: E402

# (framework, schedule, virtual_stages, mpar schedule whose simulation is the bound)
CASES = [
    ("mpar", "simple", 1, "simple"),
    ("mpar", "interleaved", 1, "interleaved"),
    ("mpar", "interleaved", 2, "interleaved"),
    ("mpar", "zero_bubble", 1, "zero_bubble"),
    ("mpar", "zero_bubble", 2, "zero_bubble"),
    # zero_bubble with room for one microbatch more than ZB-H1 on a rank, its W placed
    # from steps 3 to 5's measured times (_common.MEASURED)
    ("mpar", MEASURED, 1, "zero_bubble"),
    ("mpar", "zbv", 2, "zbv"),
    # the same schedules with their transfers through gloo instead of shared memory
    ("mpar", "interleaved" + BACKEND, 1, "interleaved"),
    ("mpar", "zero_bubble" + BACKEND, 1, "zero_bubble"),
    ("torch", "ScheduleGPipe", 1, "simple"),
    ("torch", "Schedule1F1B", 1, "interleaved"),
    ("torch", "ScheduleInterleaved1F1B", 2, "interleaved"),
    ("torch", "ScheduleInterleavedZeroBubble", 2, "zero_bubble"),
    # ZBV places a rank's two stages in a V (r and 2p-1-r); mpar's looped zero_bubble
    # with the same costs is the bound shown for it.
    ("torch", "ScheduleZBVZeroBubble", 2, "zero_bubble"),
    ("deepspeed", "TrainSchedule", 1, "interleaved"),
]
QUICK_CASES = {
    ("mpar", "interleaved", 1),
    ("torch", "Schedule1F1B", 1),
    ("deepspeed", "TrainSchedule", 1),
}
"""``--quick`` runs one 1F1B case per framework."""
PEER_MODULES = {"torch": "torch.distributed.pipelining", "deepspeed": "deepspeed"}


# -- worker side ---------------------------------------------------------------------


def _worker(case: Case, out: Path) -> None:
    if case.framework == "mpar":
        from peers import mpar_pipe as impl
    elif case.framework == "torch":
        from peers import torch_pipe as impl
    else:
        from peers import deepspeed_pipe as impl
    result = impl.run(case)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result))


# -- launching -----------------------------------------------------------------------


def _launch(
    framework: str,
    nproc: int,
    worker_args: list[str],
    threads: int,
    timeout: float,
    mmap_threshold: bool = False,
) -> dict[str, Any]:
    """Start one job; its rank 0 writes the result to a file we read back."""
    script = HERE / "pipeline.py"
    return launch_job(framework, nproc, script, worker_args, threads, timeout, mmap_threshold)


def _overhead(trace: Path) -> dict[str, Any]:
    """The runtime's overhead per action kind over every step the ranks' timelines kept:
    median µs per action, and its total per step (mean over ranks)."""
    from mpar.schedule._measured import overhead_by_kind

    files = [json.loads(f.read_text()) for f in sorted(trace.glob("rank*.timeline.json"))]
    per_kind: dict[str, list[float]] = {}
    per_step: list[float] = []
    for f in files:
        for step in f["steps"]:
            for kind, (n, us) in overhead_by_kind([step["actions"]]).items():
                per_kind.setdefault(kind, []).extend([us] * n)
            total = sum(n * us for n, us in overhead_by_kind([step["actions"]]).values())
            per_step.append(total)
    return {
        "us_per_action": {k: statistics.median(v) for k, v in sorted(per_kind.items())},
        "actions_per_step": {k: len(v) // max(1, len(per_step)) for k, v in per_kind.items()},
        "ms_per_step_per_rank": statistics.median(per_step) / 1e3 if per_step else 0.0,
    }


def _run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """One job of ``case``, started again once if it fails (a port taken, say)."""
    if args.overhead:
        with tempfile.TemporaryDirectory(prefix="mpar-overhead-") as trace:
            os.environ["MPAR_TRACE"] = trace
            try:
                got = _run_case_once(case, args)
            finally:
                del os.environ["MPAR_TRACE"]
            if got["status"] == "ok":
                got["overhead"] = _overhead(Path(trace))
            return got
    return _run_case_once(case, args)


def _run_case_once(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    worker = ["--worker", case.to_json()]
    load = os.getloadavg()[0]
    got = _launch(
        case.framework, case.world, worker, args.threads, args.timeout, args.mmap_threshold
    )
    if got["status"] != "ok":
        print(f"  failed, once more: {_last_line(got['reason'])}", file=sys.stderr, flush=True)
        first = got["reason"]
        got = _launch(
            case.framework, case.world, worker, args.threads, args.timeout, args.mmap_threshold
        )
        got["first_failure"] = first
    got["load_before"] = load
    got["load_after"] = os.getloadavg()[0]
    return got


# -- orchestration -------------------------------------------------------------------


def _cases(args: argparse.Namespace, spec: ModelSpec) -> list[tuple[Case, str]]:
    rows = [(*row, "uniform") for row in CASES]
    if args.auto:
        rows.insert(3, ("mpar", "interleaved", 1, "interleaved", "auto"))
        rows.insert(4, ("mpar", "zero_bubble", 1, "zero_bubble", "auto"))
    for csv in map(str, (Path(name).resolve() for name in args.mpar_csv)):
        rows.append(("mpar", csv, 1, csv, "uniform"))  # bound: the CSV's schedule, simulated
    cases = []
    for layout in args.layouts:
        pp, dp = (int(v) for v in layout.split("x"))
        for framework, schedule, v, sim, split in rows:
            # a CSV was asked for by name: the filters of the named schedules leave it in
            if not is_csv_path(schedule) and (
                (args.quick and (framework, schedule, v) not in QUICK_CASES)
                or (args.schedules and schedule not in args.schedules)
                or (args.only and f"{framework}:{schedule}:{v}" not in args.only)
            ):
                continue
            if framework in args.frameworks:
                # the measured placement switches after its fifth step: time after it
                warmup = max(args.warmup, 12) if schedule == MEASURED else args.warmup
                case = Case(framework, schedule, pp, dp, v, spec, warmup, args.steps, split)
                cases.append((case, sim))
    return cases


def _measure_costs(args: argparse.Namespace, spec: ModelSpec) -> dict[str, Any]:
    """Per-layer costs for each data-parallel degree (its microbatch size), in this process."""
    import torch
    from _bound import measure

    torch.set_num_threads(args.threads)
    costs = {}
    for dp in sorted({int(layout.split("x")[1]) for layout in args.layouts}):
        costs[f"dp{dp}"] = measure(spec, dp, rounds=5 if args.quick else 20)
    return costs


def _summarise(case: Case, sim: str, runs: list[dict[str, Any]], costs: Any) -> dict[str, Any]:
    from _bound import bound

    row: dict[str, Any] = {
        "layout": f"pp{case.pp} x dp{case.dp}",
        "ranks": case.world,
        "framework": case.framework,
        "schedule": case.schedule,
        "virtual_stages": case.virtual_stages,
        # a hand-placed schedule's row stays out of the "best" and acceptance figures,
        # which take the uniform split's named schedules
        "split": _split_label(case),
        "bound_schedule": sim,
    }
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        row["status"] = runs[0]["status"] if runs else "skipped"
        row["reason"] = runs[0].get("reason", "") if runs else ""
        return row
    samples = [case.model.batch / r["step_s"] for r in ok]
    row["samples_per_s_by_round"] = [
        case.model.batch / r["step_s"] if r["status"] == "ok" else None for r in runs
    ]
    step_s = statistics.median(r["step_s"] for r in ok)
    stage_layers = ok[0]["stage_layers"]
    sim_bound = bound(costs, sim, case.pp, case.model.microbatches, stage_layers)
    row.update(
        status="ok",
        samples_per_s=statistics.median(samples),
        samples_per_s_runs=samples,
        step_ms=1000 * step_s,
        bound_ms=1000 * sim_bound["bound_s"],
        bound_bubble_fraction=sim_bound["bubble_fraction"],
        efficiency=sim_bound["bound_s"] / step_s,
        stage_layers=stage_layers,
        failed_runs=len(runs) - len(ok),
    )
    return row


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mpar / peer throughput, schedule by schedule, per layout (plus best vs best)."""
    pairs = {
        ("simple", 1): [("torch", "ScheduleGPipe")],
        ("interleaved", 1): [("torch", "Schedule1F1B"), ("deepspeed", "TrainSchedule")],
        ("interleaved", 2): [("torch", "ScheduleInterleaved1F1B")],
    }
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        here = [r for r in rows if r["layout"] == layout and r["status"] == "ok"]
        for mine in (r for r in here if r["framework"] == "mpar" and r["split"] == "uniform"):
            for fw, sched in pairs.get((mine["schedule"], mine["virtual_stages"]), []):
                for peer in (r for r in here if (r["framework"], r["schedule"]) == (fw, sched)):
                    out.append(
                        {
                            "layout": layout,
                            "mpar": f"{mine['schedule']} v{mine['virtual_stages']}",
                            "peer": f"{fw} {sched}",
                            "ratio": mine["samples_per_s"] / peer["samples_per_s"],
                        }
                    )
        best = {}
        for fw in ("mpar", "torch", "deepspeed"):
            candidates = [r for r in here if r["framework"] == fw and r["split"] == "uniform"]
            if candidates:
                best[fw] = max(candidates, key=lambda r: r["samples_per_s"])
        for fw in ("torch", "deepspeed"):
            if "mpar" in best and fw in best:
                out.append(
                    {
                        "layout": layout,
                        "mpar": "best " + _label(best["mpar"]),
                        "peer": f"best {fw} {_label(best[fw])}",
                        "ratio": best["mpar"]["samples_per_s"] / best[fw]["samples_per_s"],
                    }
                )
    return out


def _split_label(case: Case) -> str:
    """The row's split; rows that are not a named schedule on its own (a schedule CSV,
    the measured placement, which adds memory) are marked and kept out of the best and
    acceptance figures."""
    if is_csv_path(case.schedule):
        return f"{case.split} (schedule CSV)"
    if case.schedule == MEASURED:
        return f"{case.split} (measured placement)"
    if case.schedule.endswith(BACKEND):
        return f"{case.split} (transfers through gloo)"
    return case.split


ZERO_BUBBLE = {
    "mpar": {"zero_bubble", "zbv"},
    "torch": {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"},
}


def _round_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The acceptance figures, each the median over rounds of a ratio taken within its
    round (the engines of one round ran one after another, so they saw the same load):

    * mpar's best / the best peer (torch's schedules and DeepSpeed);
    * mpar's best zero-bubble schedule / torch ``Schedule1F1B``;
    * mpar's best zero-bubble schedule / torch's best zero-bubble schedule.
    """
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        here = [r for r in rows if r["layout"] == layout and r["status"] == "ok"]
        here = [r for r in here if r["split"] == "uniform"]
        groups = {
            "mpar best": [r for r in here if r["framework"] == "mpar"],
            "mpar best zero-bubble": [
                r for r in here if r["framework"] == "mpar" and r["schedule"] in ZERO_BUBBLE["mpar"]
            ],
            "best peer": [r for r in here if r["framework"] != "mpar"],
            "torch Schedule1F1B": [
                r for r in here if (r["framework"], r["schedule"]) == ("torch", "Schedule1F1B")
            ],
            "torch best zero-bubble": [
                r
                for r in here
                if r["framework"] == "torch" and r["schedule"] in ZERO_BUBBLE["torch"]
            ],
        }
        for mine, peer in (
            ("mpar best", "best peer"),
            ("mpar best zero-bubble", "torch Schedule1F1B"),
            ("mpar best zero-bubble", "torch best zero-bubble"),
        ):
            ratios, winners = [], []
            rounds = min((len(r["samples_per_s_by_round"]) for r in here), default=0)
            for k in range(rounds):
                a = _best_in_round(groups[mine], k)
                b = _best_in_round(groups[peer], k)
                if a is not None and b is not None:
                    ratios.append(a[0] / b[0])
                    winners.append(f"{a[1]} / {b[1]}")
            if ratios:
                bounds = [
                    min((r["bound_ms"] for r in groups[g] if r.get("bound_ms")), default=None)
                    for g in (mine, peer)
                ]
                out.append(
                    {
                        "layout": layout,
                        "mpar": mine,
                        "peer": peer,
                        "median_round_ratio": statistics.median(ratios),
                        # the ratio if every engine ran at its bound: what the schedules
                        # and the split allow with these kernels, before any overhead
                        "bound_ratio": bounds[1] / bounds[0] if None not in bounds else None,
                        "round_ratios": ratios,
                        "round_best": winners,
                    }
                )
    return out


def _best_in_round(rows: list[dict[str, Any]], k: int) -> tuple[float, str] | None:
    """The fastest of ``rows`` in round ``k``: (samples/s, its label)."""
    got = [
        (r["samples_per_s_by_round"][k], f"{r['framework']} {_label(r)}")
        for r in rows
        if r["samples_per_s_by_round"][k] is not None
    ]
    return max(got) if got else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip().replace("|", "/") if lines else ""


def _label(row: dict[str, Any]) -> str:
    v = row["virtual_stages"]
    return row["schedule"] + (f" v{v}" if v > 1 else "")


def _markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        "# Pipeline benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['machine']}; torch {meta['torch']}; deepspeed {meta['deepspeed']}; "
        f"{meta['threads']} thread(s) per rank; gloo on loopback.",
        f"Model: {meta['model']}; global batch {meta['model']['batch']}, "
        f"{meta['model']['microbatches']} microbatches; SGD. {meta['warmup']} warm-up + "
        f"{meta['steps']} timed steps, median of {meta['repeats']} runs.",
        "",
        "| layout | framework | schedule | split | samples/s (median) | runs | step ms "
        "| bound ms | efficiency |",
        "|---|---|---|---|---:|---|---:|---:|---:|",
    ]
    cores = os.cpu_count() or 1
    for r in report["rows"]:
        star = " *" if r["ranks"] > cores else ""
        head = f"| {r['layout']}{star} | {r['framework']} | {_label(r)} | {r['split']} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']}: {_last_line(r.get('reason', ''))} | | | | |")
            continue
        runs = ", ".join(f"{s:.1f}" for s in r["samples_per_s_runs"])
        lines.append(
            head + f"| {r['samples_per_s']:.1f} | {runs} | {r['step_ms']:.0f} "
            f"| {r['bound_ms']:.0f} | {100 * r['efficiency']:.0f}% |"
        )
    loads = [
        run["load_before"]
        for runs in report["runs"].values()
        for run in runs
        if "load_before" in run
    ]
    if loads:
        lines += [
            "",
            f"1-minute load average before each run: {min(loads):.1f} to {max(loads):.1f} "
            f"(median {statistics.median(loads):.1f}) on {cores} cores; the machine is shared, "
            "so the spread between runs is large.",
        ]
    lines += [
        "",
        "Acceptance figures: the median over rounds of the ratio within each round "
        "(in a round every engine ran once, one after another).",
        "",
        "| layout | mpar | peer | median of per-round ratios | at the bounds | per-round ratios |",
        "|---|---|---|---:|---:|---|",
    ]
    for q in report.get("round_ratios", []):
        per_round = ", ".join(f"{v:.2f}" for v in q["round_ratios"])
        at_bounds = "" if q.get("bound_ratio") is None else f"{q['bound_ratio']:.2f}"
        lines.append(
            f"| {q['layout']} | {q['mpar']} | {q['peer']} | {q['median_round_ratio']:.2f} "
            f"| {at_bounds} | {per_round} |"
        )
    lines += ["", "| layout | mpar | peer | mpar / peer (medians) |", "|---|---|---|---:|"]
    for q in report["ratios"]:
        lines.append(f"| {q['layout']} | {q['mpar']} | {q['peer']} | {q['ratio']:.2f} |")
    lines += [
        "",
        "Bound: `mpar.schedule.simulate` of the row's schedule (GPipe rows: `simple`; 1F1B "
        "and DeepSpeed rows: `interleaved`) with per-layer forward/backward times of one "
        "microbatch summed over the stages of the split the run used, no communication "
        "cost, plus the slowest rank's optimizer step. Efficiency = bound / measured step "
        "time. At the bounds: the peer's best bound / mpar's best bound, the ratio if every "
        "engine ran at its bound (what the schedules allow with this split and these "
        "kernels, before any runtime's overhead).",
        "",
    ]
    if any(r["ranks"] > cores for r in report["rows"]):
        lines += [
            f"\\* more ranks than the {cores} cores: the bound assumes a core per rank, so "
            f"these rows cannot pass about {cores} / ranks efficiency; compare them with "
            "each other, not with the bound.",
            "",
        ]
    return "\n".join(lines)


def _meta(args: argparse.Namespace, spec: ModelSpec) -> dict[str, Any]:
    import torch

    try:
        from importlib.metadata import version

        ds = version("deepspeed")
    except Exception:
        ds = "not installed"
    return {
        "command": "python benchmarks/pipeline.py " + shlex.join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": ds,
        "threads": args.threads,
        "model": spec.__dict__,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "split": "uniform: equal layer counts per stage for every framework",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _report_overhead(
    args: argparse.Namespace,
    spec: ModelSpec,
    cases: list[tuple[Case, str]],
    runs: dict[int, list[dict[str, Any]]],
) -> int:
    """``--overhead``: µs per action kind, the median over the runs of each case."""
    rows = []
    for i, (case, _) in enumerate(cases):
        ok = [r for r in runs[i] if r["status"] == "ok" and "overhead" in r]
        if not ok:
            continue
        kinds = sorted({k for r in ok for k in r["overhead"]["us_per_action"]})
        rows.append(
            {
                "schedule": f"{case.schedule} v{case.virtual_stages}",
                "step_ms": 1000 * statistics.median(r["step_s"] for r in ok),
                "overhead_ms_per_step_per_rank": statistics.median(
                    r["overhead"]["ms_per_step_per_rank"] for r in ok
                ),
                "us_per_action": {
                    k: statistics.median(
                        r["overhead"]["us_per_action"][k]
                        for r in ok
                        if k in r["overhead"]["us_per_action"]
                    )
                    for k in kinds
                },
                "actions_per_step": ok[0]["overhead"]["actions_per_step"],
            }
        )
    kinds = [k for k in ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")]
    loads = [r["load_before"] for rs in runs.values() for r in rs if "load_before" in r]
    lines = [
        "# Executor overhead per action (µs outside compute and waits)",
        "",
        f"Command: `{_meta(args, spec)['command']}`",
        "",
        f"Model: {spec.__dict__}; traced runs; median over {args.repeats} runs of each "
        f"run's median per kind; load average {min(loads, default=0):.1f} to "
        f"{max(loads, default=0):.1f}.",
        "",
        "| schedule | step ms | overhead ms/step/rank | " + " | ".join(kinds) + " |",
        "|---|---:|---:|" + "---:|" * len(kinds),
    ]
    for r in rows:
        cells = [f"{r['us_per_action'][k]:.0f}" if k in r["us_per_action"] else "" for k in kinds]
        lines.append(
            f"| {r['schedule']} | {r['step_ms']:.1f} | {r['overhead_ms_per_step_per_rank']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": _meta(args, spec), "rows": rows, "runs": runs}
    (args.out / "executor_overhead.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "executor_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layouts", nargs="+", default=["2x1"], help="pp x dp layouts (2x1 4x1 2x2)")
    p.add_argument("--frameworks", nargs="+", default=["mpar", "torch", "deepspeed"])
    p.add_argument(
        "--schedules", nargs="+", help="only these schedules (e.g. Schedule1F1B zero_bubble)"
    )
    p.add_argument(
        "--only",
        nargs="+",
        help="only these cases, as FRAMEWORK:SCHEDULE:VIRTUAL_STAGES "
        "(e.g. mpar:zero_bubble:1 torch:Schedule1F1B:1)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--auto", action="store_true", help="also run mpar's profile-driven split")
    p.add_argument(
        "--mpar-csv",
        nargs="+",
        default=[],
        metavar="FILE.csv",
        help="also run mpar with these schedule CSVs (hand-placed schedules: shown in the "
        "tables, left out of the acceptance figures)",
    )
    p.add_argument(
        "--overhead",
        action="store_true",
        help="mpar only, traced: the runtime's µs per action outside compute "
        "(writes executor_overhead.json/md)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat: a smoke run")
    p.add_argument(
        "--mmap-threshold",
        action="store_true",
        help="run the jobs with MALLOC_MMAP_THRESHOLD_=65536 (tight RSS peaks, ~1.5x slower "
        "steps in every framework); off by default: this benchmark is about speed",
    )
    p.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.overhead:
        args.frameworks = ["mpar"]
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 1, 2
        args.layers, args.d_model, args.seq, args.vocab = 2, 32, 16, 64
        args.batch, args.microbatches = 8, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(Case.from_json(args.worker), args.result)
        return 0
    spec = ModelSpec(
        vocab=args.vocab,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=4,
        seq=args.seq,
        batch=args.batch,
        microbatches=args.microbatches,
    )
    cases = _cases(args, spec)
    costs = {} if args.overhead else _measure_costs(args, spec)
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cases))}
    for repeat in range(args.repeats):
        for i, (case, _) in enumerate(cases):
            reason = missing_module(PEER_MODULES.get(case.framework))
            if reason is not None:
                runs[i].append({"status": "skipped", "reason": reason})
                continue
            got = _run_case(case, args)
            runs[i].append(got)
            shown = (
                f"{case.model.batch / got['step_s']:.1f} samples/s"
                if got["status"] == "ok"
                else f"{got['status']}: {_last_line(got['reason'])}"
            )
            print(
                f"[{repeat + 1}/{args.repeats}] pp{case.pp}xdp{case.dp} {case.framework} "
                f"{case.schedule} v{case.virtual_stages} {case.split}: {shown}",
                flush=True,
            )
    if args.overhead:
        return _report_overhead(args, spec, cases, runs)
    rows = [
        _summarise(case, sim, runs[i], costs[f"dp{case.dp}"]) for i, (case, sim) in enumerate(cases)
    ]
    report = {
        "meta": _meta(args, spec),
        "stage_costs": costs,
        "rows": rows,
        "ratios": _ratios(rows),
        "round_ratios": _round_ratios(rows),
        "runs": {str(i): runs[i] for i in runs},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(report, indent=1))
    (args.out / "pipeline.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
