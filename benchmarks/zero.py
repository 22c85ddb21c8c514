"""ZeRO data-parallel training throughput and model-state memory: mpar against its peers.

One MLP (``benchmarks/zero_peers/common.py``: ``Linear`` + GELU, about 4.7 M fp32
parameters by default) is trained with torch's AdamW on the same fixed global
batch, one intra-op thread per rank, pp = 1, on ``--dps`` data-parallel ranks by

* mpar: ``zero.stage`` 1, 2, 3, each without and with offload
  (``offload_optimizer: cpu``; stage 3 also ``offload_params: cpu``); ``mpar launch``;
* DeepSpeed: ``deepspeed.initialize`` with ``zero_optimization.stage`` 1-3, offload
  off/on, CPU accelerator, gloo, torch AdamW as client optimizer; ``torchrun``;
* FSDP2: ``fully_shard`` per ``Linear`` + root (stage 3), without and with
  ``CPUOffloadPolicy``; ``torchrun``;
* torch ``ZeroRedundancyOptimizer`` + DDP (stage 1); ``torchrun``;
* fairscale: ``OSS`` + ``ShardedDataParallel`` (stage 2, no offload: it has none) and
  ``FullyShardedDataParallel`` per ``Linear`` + root (stage 3, offload =
  ``move_params_to_cpu``); ``torchrun``.

Each case runs in its own processes: ``--warmup`` untimed steps, then ``--steps``
timed steps between barriers; cases run ``--repeats`` times round-robin and the
median samples/s is reported with mpar / peer ratios at the same stage and
offload setting. Model-state bytes per rank (parameters, gradients, optimizer
state, counted as distinct storages after one more forward + backward) come
from ``mpar.memory_report()`` for mpar and from the peers' own tensors.

Correctness on the side: after the timed steps of the first repeat, every case
saves its full trained parameters; they are compared with one process training
the unwrapped model on the whole batch for the same number of steps, and mpar
with each peer at the same stage.

    python benchmarks/zero.py                      # dp 2 and 4, writes benchmarks/results/
    python benchmarks/zero.py --dps 2 --repeats 5
    python benchmarks/zero.py --quick --out /tmp/z # smoke run

``ZERO_BENCH_PROFILE=/tmp/prof`` writes a cProfile file per rank and case there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import launch_job, missing_module  # noqa: E402
from zero_peers.common import MLPSpec, ZeroCase  # noqa: E402

FRAMEWORKS = ("mpar", "deepspeed", "fsdp2", "torch_zero", "fairscale")
PEER_MODULES = {
    "deepspeed": "deepspeed",
    "fairscale": "fairscale",
    "fsdp2": "torch.distributed.fsdp",
    "torch_zero": "torch.distributed.optim",
}
QUICK_CELLS = {
    ("mpar", 1, False),
    ("torch_zero", 1, False),
    ("mpar", 3, True),
    ("deepspeed", 3, True),
    ("fsdp2", 3, True),
    ("fairscale", 2, False),
}
"""``--quick``: every framework once (six jobs), DeepSpeed, FSDP2 and torch's next to
mpar at their stage; fairscale at stage 2 (its stage 3 needs CUDA), checked against
the one-process reference."""
TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
"""fp32 agreement of trained parameters (AdamW, a few steps)."""


# -- worker side ---------------------------------------------------------------------


def _worker(case: ZeroCase, out: Path) -> None:
    import importlib

    module = {
        "mpar": "mpar_zero",
        "deepspeed": "deepspeed_zero",
        "fsdp2": "fsdp2",
        "torch_zero": "torch_zero",
        "fairscale": "fairscale_zero",
    }[case.framework]
    impl = importlib.import_module(f"zero_peers.{module}")
    profile_dir = os.environ.get("ZERO_BENCH_PROFILE")
    if profile_dir:  # cProfile every rank: ZERO_BENCH_PROFILE=/tmp/prof python zero.py ...
        import cProfile

        name = f"{case.framework}-z{case.stage}{'o' if case.offload else ''}-dp{case.dp}"
        path = Path(profile_dir) / f"{name}-rank{os.environ.get('RANK', '0')}.prof"
        path.parent.mkdir(parents=True, exist_ok=True)
        with cProfile.Profile() as prof:
            result = impl.run(case)
        prof.dump_stats(path)
    else:
        result = impl.run(case)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result))


# -- launching -----------------------------------------------------------------------


def _unsupported(case: ZeroCase) -> str | None:
    """Why an installed peer cannot run this case here (reported as skipped), or None."""
    if case.framework != "fairscale":
        return None
    from zero_peers.fairscale_zero import unsupported

    return unsupported(case.stage)


def _launch(case: ZeroCase, threads: int, timeout: float) -> dict[str, Any]:
    """Start one job; its rank 0 writes the result to a file we read back."""
    worker = ["--worker", case.to_json()]
    return launch_job(case.framework, case.dp, HERE / "zero.py", worker, threads, timeout)


# -- cases and reference -------------------------------------------------------------


def _cases(args: argparse.Namespace, spec: MLPSpec) -> list[ZeroCase]:
    cases = []
    for dp in args.dps:
        for stage in args.stages:
            for offload in (False,) if args.no_offload else (False, True):
                rows = ["mpar", "deepspeed"]
                if stage == 3:
                    rows.append("fsdp2")
                if stage == 1 and not offload:
                    rows.append("torch_zero")
                if stage == 3 or (stage == 2 and not offload):
                    rows.append("fairscale")  # OSS + ShardedDataParallel has no offload
                for fw in rows:
                    if args.quick and (fw, stage, offload) not in QUICK_CELLS:
                        continue
                    if fw in args.frameworks:
                        cases.append(
                            ZeroCase(
                                fw,
                                stage,
                                offload,
                                dp,
                                spec,
                                args.warmup,
                                args.steps,
                                gather=args.zero_gather,
                            )
                        )
    return cases


def _reference(spec: MLPSpec, total_steps: int) -> Any:
    """The unwrapped model trained in one process on the whole batch."""
    import torch
    from zero_peers.common import global_batch, loss_fn, make_mlp, make_optimizer

    torch.set_num_threads(1)
    net = make_mlp(spec)
    opt = make_optimizer(net.parameters())
    x, y = global_batch(spec)
    for _ in range(total_steps):
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _agreement(a: Any, b: Any) -> dict[str, Any]:
    import torch

    diff = (a - b).abs()
    bad = diff > TOLERANCE["atol"] + TOLERANCE["rtol"] * b.abs()
    return {
        "max_abs_diff": float(diff.max()),
        "elements_outside_tolerance": int(bad.sum()),
        "agree": bool(torch.allclose(a, b, **TOLERANCE)),
    }


def _check(cases: list[ZeroCase], saved: dict[int, Path], spec: MLPSpec) -> list[dict[str, Any]]:
    """Trained parameters against the one-process reference and mpar against each peer."""
    import torch

    total = cases[0].warmup + cases[0].steps if cases else 0
    reference = _reference(spec, total)
    flat = {i: torch.load(p, weights_only=True) for i, p in saved.items() if p.exists()}
    out = []
    for i, case in enumerate(cases):
        if i not in flat:
            continue
        row = {"case": case.label(), "against": "single process", **_agreement(flat[i], reference)}
        out.append(row)
        if case.framework == "mpar":
            continue
        for j, mine in enumerate(cases):
            same = (mine.framework, mine.stage, mine.offload, mine.dp) == (
                "mpar",
                case.stage,
                case.offload,
                case.dp,
            )
            if same and j in flat:
                out.append(
                    {"case": case.label(), "against": mine.label()} | _agreement(flat[i], flat[j])
                )
    return out


# -- summarising ---------------------------------------------------------------------


def _expected_bytes(spec: MLPSpec, stage: int, dp: int) -> int:
    """The ZeRO paper's fp32 AdamW model state per rank (4 bytes params, 4 grads, 8 state)."""
    psi = spec.num_parameters()
    params = 4 * psi / (dp if stage >= 3 else 1)
    grads = 4 * psi / (dp if stage >= 2 else 1)
    return int(params + grads + 8 * psi / dp)


def _summarise(case: ZeroCase, runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "dp": case.dp,
        "framework": case.framework,
        "stage": case.stage,
        "offload": case.offload,
        "expected_model_state_bytes": _expected_bytes(case.model, case.stage, case.dp),
    }
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        row["status"] = runs[0]["status"] if runs else "skipped"
        row["reason"] = runs[0].get("reason", "") if runs else ""
        return row
    samples = [case.model.batch / r["median_step_s"] for r in ok]
    memory = ok[0]["memory_per_rank"]
    totals = [sum(m.values()) for m in memory]
    peaks = [max(p["peak_above_baseline_bytes"] for p in r["peak_per_rank"]) for r in ok]
    row.update(
        status="ok",
        samples_per_s=statistics.median(samples),
        samples_per_s_runs=samples,
        step_ms=1000 * statistics.median(r["median_step_s"] for r in ok),
        memory_per_rank=memory,
        model_state_bytes_max=max(totals),
        peak_above_baseline_bytes=statistics.median(peaks),
        peak_above_baseline_runs=peaks,
        rss_peak_bytes_max=max(p["rss_peak_bytes"] for p in ok[0]["peak_per_rank"]),
        reported_peaks_per_rank=ok[0].get("reported_peaks_per_rank"),
        failed_runs=len(runs) - len(ok),
        extra={k: v for k, v in ok[0].items() if k == "zero_optimizer"},
        retried_after=ok[0].get("retried_after", []),
    )
    return row


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mpar / peer samples/s at the same dp, stage and offload setting."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for peer in (r for r in ok if r["framework"] != "mpar"):
        for mine in ok:
            key = ("mpar", peer["dp"], peer["stage"], peer["offload"])
            if (mine["framework"], mine["dp"], mine["stage"], mine["offload"]) == key:
                out.append(
                    {
                        "dp": peer["dp"],
                        "stage": peer["stage"],
                        "offload": peer["offload"],
                        "peer": peer["framework"],
                        "ratio": mine["samples_per_s"] / peer["samples_per_s"],
                        "memory_ratio": mine["model_state_bytes_max"]
                        / peer["model_state_bytes_max"],
                        "peak_ratio": mine["peak_above_baseline_bytes"]
                        / max(1, peer["peak_above_baseline_bytes"]),
                    }
                )
    return out


def _unit(parameters: int) -> tuple[str, int]:
    """MiB for the real model, KiB for the tiny ``--quick`` one."""
    return ("MiB", 2**20) if 4 * parameters >= 2**22 else ("KiB", 2**10)


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0].strip().replace("|", "/")[:300] if lines else ""


def _markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    spec = meta["model"]
    unit, scale = _unit(meta["parameters"])

    def size(n: float) -> str:
        return f"{n / scale:.1f}"

    lines = [
        "# ZeRO benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['machine']}; {meta['threads']} thread(s) per rank; gloo on loopback; pp = 1.",
        f"Versions: mpar {meta.get('mpar', '?')}, torch {meta['torch']}, "
        f"deepspeed {meta['deepspeed']}, fairscale {meta.get('fairscale', '?')}.",
        f"mpar imported from `{meta['mpar_source']}` (repository HEAD {meta['git_head']}).",
        f"Model: MLP {spec['d_in']} -> {spec['layers'] + 1} x {spec['hidden']} -> "
        f"{spec['classes']} (GELU), {meta['parameters']:,} fp32 parameters; global batch "
        f"{spec['batch']}; torch AdamW (lr 1e-3, weight decay 0.01) for every framework. "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps per run; samples/s from the "
        f"median step, median of {meta['repeats']} runs.",
        "",
        "Model state = parameters + gradients + optimizer state (fp32 master copies "
        f"included) per rank, {unit}, distinct storages, measured after a forward + backward; "
        "shown as the largest rank's `params / grads / optimizer = total`. "
        "ZeRO formula: the paper's fp32 AdamW per-rank bytes (4/4/8 bytes per parameter, "
        "sharded by stage). Step peak = the busiest rank's RSS peak during the timed steps "
        "above its RSS right before them (sampled every 2 ms, `MALLOC_MMAP_THRESHOLD_=65536`; "
        "median of the runs): what a step holds beyond the state kept between steps.",
        "",
        "| dp | stage | offload | framework | samples/s (median) | runs | step ms "
        f"| model state {unit} (p / g / o = total) | ZeRO formula {unit} | step peak {unit} |",
        "|---|---|---|---|---:|---|---:|---|---:|---:|",
    ]
    for r in report["rows"]:
        head = (
            f"| {r['dp']} | {r['stage']} | {'cpu' if r['offload'] else '-'} | "
            f"{_name(r['framework'], r['stage'])} "
        )
        if r["status"] != "ok":
            lines.append(
                head + f"| {r['status']}: {_first_line(r.get('reason', ''))} | | | | "
                f"{size(r['expected_model_state_bytes'])} |"
            )
            continue
        runs = ", ".join(f"{s:.0f}" for s in r["samples_per_s_runs"])
        big = max(r["memory_per_rank"], key=lambda m: sum(m.values()))
        mem = (
            f"{size(big['parameters'])} / {size(big['gradients'])} / {size(big['optimizer'])} "
            f"= {size(sum(big.values()))}"
        )
        lines.append(
            head + f"| {r['samples_per_s']:.0f} | {runs} | {r['step_ms']:.1f} | {mem} "
            f"| {size(r['expected_model_state_bytes'])} "
            f"| {size(r['peak_above_baseline_bytes'])} |"
        )
    lines += [
        "",
        "| dp | stage | offload | peer | mpar / peer samples/s | mpar / peer model state "
        "| mpar / peer step peak |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for q in report["ratios"]:
        lines.append(
            f"| {q['dp']} | {q['stage']} | {'cpu' if q['offload'] else '-'} | {_name(q['peer'], q['stage'])} "
            f"| {q['ratio']:.2f} | {q['memory_ratio']:.2f} | {q['peak_ratio']:.2f} |"
        )
    retried = [r for r in report["rows"] if r.get("retried_after")]
    if retried:
        lines += ["", "Runs that failed once and were retried (the failure, first line):", ""]
        for r in retried:
            label = f"dp {r['dp']} stage {r['stage']}{' offload' if r['offload'] else ''}"
            for reason in r["retried_after"]:
                lines.append(
                    f"- {_name(r['framework'], r['stage'])} {label}: `{_first_line(reason.split(chr(10), 1)[-1])}`"
                )
    accounted = [
        r for r in report["rows"] if r["status"] == "ok" and r.get("reported_peaks_per_rank")
    ]
    if accounted:
        lines += [
            "",
            "mpar's step peak, counted (`memory_report()`: gathered parameters + gradient "
            f"buffers + activations saved for backward, busiest rank, {unit}) against measured:",
            "",
            "| dp | stage | offload | gathered | gradients | activations | counted total "
            "| measured step peak | measured / counted |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in accounted:
            big = max(r["reported_peaks_per_rank"], key=lambda m: sum(m.values()))
            total = sum(big.values())
            measured = r["peak_above_baseline_bytes"]
            lines.append(
                f"| {r['dp']} | {r['stage']} | {'cpu' if r['offload'] else '-'} "
                f"| {size(big['gathered_peak'])} | {size(big['gradients_peak'])} "
                f"| {size(big['activations'])} | {size(total)} | {size(measured)} "
                f"| {measured / max(1, total):.2f} |"
            )
    lines += ["", *(f"- {note}" for note in NOTES)]
    if report["correctness"]:
        lines += [
            "",
            f"Trained parameters after {meta['warmup'] + meta['steps']} steps "
            f"(tolerance atol {TOLERANCE['atol']}, rtol {TOLERANCE['rtol']}):",
            "",
            "| case | against | max abs diff | elements outside | agree |",
            "|---|---|---:|---:|---|",
        ]
        for c in report["correctness"]:
            lines.append(
                f"| {c['case']} | {c['against']} | {c['max_abs_diff']:.2e} "
                f"| {c['elements_outside_tolerance']} | {'yes' if c['agree'] else '**no**'} |"
            )
    lines.append("")
    return "\n".join(lines)


NOTES = [
    "How each framework runs: mpar with `mpar launch`; the peers with `torchrun "
    "--standalone` (DeepSpeed: `deepspeed.init_distributed('gloo')`, `DS_ACCELERATOR=cpu`, "
    "torch AdamW as client optimizer, `zero_force_ds_cpu_optimizer: false`, "
    "`gradient_clipping: 0` because its default 1.0 would clip where nobody else does; "
    "FSDP2: `fully_shard` per Linear + root on a 1-D CPU mesh; "
    "ZeroRedundancyOptimizer: DDP with `gradient_as_bucket_view=True`; "
    "fairscale: `OSS(AdamW)` + `ShardedDataParallel` at stage 2, which has no offload, and "
    "`FullyShardedDataParallel` per Linear + root at stage 3 with `compute_device=cpu`, "
    "`flatten_parameters=True`, `mixed_precision=False`, offload = `move_params_to_cpu`).",
    "On this CPU-only machine the offload target is the same memory as the 'device': "
    "offload adds host copies (fp32 master, gradient slice) instead of moving bytes, so "
    "offload rows hold more model state than the formula, not less.",
    "DeepSpeed keeps an fp32 master partition even in fp32 training (the paper's K = 12 "
    "instead of 8), visible as its larger optimizer column.",
    "fairscale's ShardedDataParallel reduces each gradient to its owner only, but its "
    "reduce buckets (one per destination rank, `reduce_buffer_size` 2**23 elements by "
    "default) hold every gradient on every rank as bucket views, so its gradient column is "
    "the full 4 bytes per parameter (ZeRO-1's), not ZeRO-2's 4 / dp. Its steps end with "
    "`model.zero_grad()` (ShardedDataParallel's): `OSS.zero_grad()` left stale bucket "
    "contents in the next step's gradients and the trained parameters off.",
    "fairscale's FullyShardedDataParallel (0.4.13) runs only with CUDA: its forward enters "
    "`torch.cuda.stream(self._streams['all_gather'])`, and `_streams` is filled only when "
    "`torch.cuda.is_available()`; on a CPU-only torch its rows are reported as skipped.",
]


def _name(framework: str, stage: int) -> str:
    if framework == "fairscale":
        return "fairscale FSDP" if stage == 3 else "fairscale OSS + ShardedDDP"
    return {
        "mpar": "mpar",
        "deepspeed": "DeepSpeed",
        "fsdp2": "FSDP2",
        "torch_zero": "ZeroRedundancyOptimizer + DDP",
    }[framework]


def _meta(args: argparse.Namespace, spec: MLPSpec) -> dict[str, Any]:
    import torch
    from _common import package_version

    import mpar

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        head = ""
    return {
        "command": "python benchmarks/zero.py " + shlex.join(sys.argv[1:]),
        "mpar_source": str(Path(mpar.__file__).parent),
        "git_head": head,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "mpar": mpar.__version__,
        "torch": torch.__version__,
        "deepspeed": package_version("deepspeed"),
        "fairscale": package_version("fairscale"),
        "threads": args.threads,
        "model": spec.__dict__,
        "parameters": spec.num_parameters(),
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dps", type=int, nargs="+", default=[2, 4], help="data-parallel sizes")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument(
        "--zero-gather", default="unit", help="mpar's zero.gather (unit, chunk or an int)"
    )
    p.add_argument("--d-in", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="hidden-to-hidden Linear layers")
    p.add_argument("--classes", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--no-check", action="store_true", help="skip the parameter comparison")
    p.add_argument("--no-offload", action="store_true", help="only the rows without offload")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, dp 2, 6 jobs, 1 repeat: a smoke run"
    )
    p.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.steps, args.dps, args.stages = 1, 1, 2, [2], [1, 2, 3]
        args.d_in, args.hidden, args.layers, args.classes, args.batch = 16, 32, 1, 8, 8
    return args


def _run_all(args: argparse.Namespace, cases: list[ZeroCase], tmp: Path) -> tuple[Any, Any]:
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cases))}
    flaky: dict[int, list[str]] = {}
    saved: dict[int, Path] = {}
    for repeat in range(args.repeats):
        for i, case in enumerate(cases):
            if len(runs[i]) > repeat:
                continue  # failed or skipped in the first repeat: recorded once
            reason = missing_module(PEER_MODULES.get(case.framework)) or _unsupported(case)
            if reason is not None:
                runs[i] += [{"status": "skipped", "reason": reason}] * args.repeats
                continue
            if repeat == 0 and not args.no_check:
                saved[i] = tmp / f"params-{i}.pt"
                case = ZeroCase(**{**case.__dict__, "params_out": str(saved[i])})
            got = _launch(case, args.threads, args.timeout)
            if got["status"] != "ok":  # one retry: some peers fail now and then
                print(f"[{repeat + 1}/{args.repeats}] {case.label()}: failed, retrying", flush=True)
                flaky.setdefault(i, []).append(got["reason"])
                got = _launch(case, args.threads, args.timeout)
            runs[i].append(got)
            shown = (
                f"{case.model.batch / got['median_step_s']:.1f} samples/s"
                if got["status"] == "ok"
                else f"{got['status']}: {_first_line(got['reason'])}"
            )
            wall = f" (job {got['job_wall_s']:.1f} s)" if "job_wall_s" in got else ""
            print(f"[{repeat + 1}/{args.repeats}] {case.label()}: {shown}{wall}", flush=True)
            if got["status"] != "ok":
                runs[i] += [got] * (args.repeats - 1 - repeat)  # not retried
    for i, reasons in flaky.items():
        for run in runs[i]:
            run.setdefault("retried_after", reasons)
    return runs, saved


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(ZeroCase.from_json(args.worker), args.result)
        return 0
    spec = MLPSpec(args.d_in, args.hidden, args.layers, args.classes, args.batch)
    cases = _cases(args, spec)
    with tempfile.TemporaryDirectory(prefix="mpar-zero-params-") as tmp:
        runs, saved = _run_all(args, cases, Path(tmp))
        correctness = [] if args.no_check else _check(cases, saved, spec)
    rows = [_summarise(case, runs[i]) for i, case in enumerate(cases)]
    report = {
        "meta": _meta(args, spec),
        "rows": rows,
        "ratios": _ratios(rows),
        "correctness": correctness,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero.json").write_text(json.dumps(report, indent=2) + "\n")
    text = _markdown(report)
    (args.out / "zero.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
