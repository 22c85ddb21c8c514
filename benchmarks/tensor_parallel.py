"""Tensor-parallel training throughput and per-rank memory: mpar against torch's own TP.

One GPT-style model (``mpar.testing.models.TinyGPT`` with separate q/k/v,
``fused_qkv=False``; ``benchmarks/tp_peers/common.py``) is trained with torch's
AdamW on the same fixed batch, one intra-op thread per rank, at ``--tp`` on
``--tp`` processes (gloo on loopback, dp = pp = 1), by

* mpar: ``mpar.init({"tensor_parallel_degree": tp, "tp_plan": GPT_TP_PLAN})``,
  ``DistributedModel``, ``DistributedOptimizer``, ``@mpar.step``; ``mpar launch``;
* torch: DTensor tensor parallelism applied by hand as torchtitan does:
  ``init_device_mesh("cpu", (tp,))``, ``parallelize_module`` with
  ``ColwiseParallel`` for q, k, v, ``mlp.0`` and ``RowwiseParallel`` for ``proj``,
  ``mlp.2`` of every block, a plain AdamW and ``loss.backward()``; ``torchrun``;
* DeepSpeed AutoTP (``tensor_parallel.autotp_size`` with a ``partition_config``
  naming the same layers) where it runs on this machine; where it does not, its
  row says why (``tp_peers/deepspeed_tp.py``).

Every engine splits the same layers (Megatron's split) and replicates the
embeddings, norms and LM head. Each job runs ``--warmup`` steps (their losses
are kept), then ``--steps`` timed steps between barriers, every rank sampling its
RSS on a thread (``_harness.measured_steps``; jobs run with
``MALLOC_MMAP_THRESHOLD_=65536``). A round runs every engine once, the order
alternating from round to round; the reported ratio is the median over rounds
of mpar / peer samples/s within the same round, so a slow phase of a shared
machine weighs on both sides of a ratio.

Sanity: every engine's warm-up losses are compared with one process training the
unwrapped model on the same batch (the first step's loss checks the split
forward; later ones the backward and the optimizer step).

    python benchmarks/tensor_parallel.py                    # tp 2, 7 rounds
    python benchmarks/tensor_parallel.py --rounds 9 --layers 8 --batch 16
    python benchmarks/tensor_parallel.py --quick --out /tmp/t   # smoke run
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import launch_job, missing_module  # noqa: E402
from tp_peers.common import TPCase, TPSpec  # noqa: E402

FRAMEWORKS = ("mpar", "torch", "deepspeed")
PEER_MODULES = {"torch": "torch.distributed.tensor.parallel", "deepspeed": "deepspeed"}
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
"""fp32 agreement of the warm-up losses with the one-process reference."""


# -- worker side ---------------------------------------------------------------------


def _worker(case: TPCase, out: Path) -> None:
    import importlib

    module = {"mpar": "mpar_tp", "torch": "torch_tp", "deepspeed": "deepspeed_tp"}
    impl = importlib.import_module(f"tp_peers.{module[case.framework]}")
    result = impl.run(case)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result))


# -- launching -----------------------------------------------------------------------


def _unsupported(framework: str) -> str | None:
    """Why an installed peer cannot run here (reported as skipped), or None."""
    if framework != "deepspeed":
        return None
    from tp_peers.deepspeed_tp import unsupported

    return unsupported()


def _run_case(case: TPCase, args: argparse.Namespace) -> dict[str, Any]:
    """One job of ``case``, started again once if it fails (a port taken, say)."""
    worker = ["--worker", case.to_json()]
    load = os.getloadavg()[0]
    script = HERE / "tensor_parallel.py"
    got = launch_job(case.framework, case.tp, script, worker, args.threads, args.timeout)
    if got["status"] != "ok":
        print(f"  failed, once more: {_first_line(got['reason'])}", file=sys.stderr, flush=True)
        first = got["reason"]
        got = launch_job(case.framework, case.tp, script, worker, args.threads, args.timeout)
        got["first_failure"] = first
    got["load_before"] = load
    got["load_after"] = os.getloadavg()[0]
    return got


def _run_rounds(
    args: argparse.Namespace,
    spec: TPSpec,
    after_round: Callable[[dict[str, list[dict[str, Any]]]], None],
) -> dict[str, list[dict[str, Any]]]:
    """``args.rounds`` rounds of one job per engine, the order reversed every other round;
    ``after_round(runs so far)`` after each (the report is rewritten, so a long run on a
    busy machine that is stopped keeps its finished rounds)."""
    runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in args.frameworks}
    skip = {fw: missing_module(PEER_MODULES.get(fw)) or _unsupported(fw) for fw in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for fw in order:
            if skip[fw] is not None:
                runs[fw].append({"status": "skipped", "reason": skip[fw]})
                continue
            case = TPCase(fw, args.tp, spec, args.warmup, args.steps)
            got = _run_case(case, args)
            runs[fw].append(got)
            shown = (
                f"{spec.batch / got['median_step_s']:.2f} samples/s (load {got['load_before']:.1f})"
                if got["status"] == "ok"
                else f"{got['status']}: {_first_line(got['reason'])}"
            )
            print(f"[{r + 1}/{args.rounds}] {fw}: {shown}", flush=True)
            if got["status"] != "ok" and fw != "mpar":
                skip[fw] = f"failed in round {r + 1}: " + got["reason"]
        after_round(runs)
    return runs


# -- reference and summaries ---------------------------------------------------------


def _reference_losses(spec: TPSpec, steps: int, threads: int) -> list[float]:
    """The unwrapped model trained in this process on the same batch: its losses."""
    import torch
    from tp_peers.common import global_batch, loss_fn, make_model, make_optimizer

    torch.set_num_threads(threads)
    model = make_model(spec)
    opt = make_optimizer(model.parameters())
    x, y = global_batch(spec)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _sanity(runs: dict[str, list[dict[str, Any]]], reference: list[float]) -> list[dict[str, Any]]:
    """Each engine's warm-up losses (first successful run) against the reference."""
    out = []
    for fw, got in runs.items():
        ok = [r for r in got if r["status"] == "ok"]
        if not ok:
            continue
        losses = ok[0]["warmup_losses"]
        diffs = [abs(a - b) for a, b in zip(losses, reference, strict=False)]
        agree = all(
            d <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(b)
            for d, b in zip(diffs, reference, strict=False)
        )
        same_every_run = all(r["warmup_losses"] == losses for r in ok)
        out.append(
            {
                "framework": fw,
                "losses": losses,
                "reference": reference[: len(losses)],
                "first_step_abs_diff": diffs[0] if diffs else None,
                "max_abs_diff": max(diffs) if diffs else None,
                "agree": agree,
                "same_every_run": same_every_run,
            }
        )
    return out


def _per_rank_memory(ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: parameter and optimizer-state bytes, and the RSS figures (medians over runs)."""
    ranks = len(ok[0]["peak_per_rank"])
    out = []
    for rank in range(ranks):
        peaks = [r["peak_per_rank"][rank] for r in ok]
        out.append(
            {
                "rank": rank,
                **ok[0]["state_per_rank"][rank],
                "rss_baseline_bytes": statistics.median(p["rss_baseline_bytes"] for p in peaks),
                "rss_peak_bytes": statistics.median(p["rss_peak_bytes"] for p in peaks),
                "peak_above_baseline_bytes": statistics.median(
                    p["peak_above_baseline_bytes"] for p in peaks
                ),
            }
        )
    return out


def _summarise(fw: str, spec: TPSpec, runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"framework": fw}
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        row["status"] = runs[0]["status"] if runs else "skipped"
        row["reason"] = runs[0].get("reason", "") if runs else ""
        return row
    samples = [spec.batch / r["median_step_s"] for r in ok]
    row.update(
        status="ok",
        samples_per_s=statistics.median(samples),
        samples_per_s_runs=samples,
        step_ms=1000 * statistics.median(r["median_step_s"] for r in ok),
        per_rank=_per_rank_memory(ok),
        failed_runs=len(runs) - len(ok),
    )
    return row


def _ratios(runs: dict[str, list[dict[str, Any]]], spec: TPSpec) -> list[dict[str, Any]]:
    """mpar / peer samples/s within each round, and their median."""
    out = []
    for peer in (fw for fw in runs if fw != "mpar"):
        per_round = [
            (spec.batch / a["median_step_s"]) / (spec.batch / b["median_step_s"])
            for a, b in zip(runs.get("mpar", []), runs[peer], strict=False)
            if a["status"] == "ok" and b["status"] == "ok"
        ]
        if per_round:
            out.append(
                {"peer": peer, "ratio": statistics.median(per_round), "per_round": per_round}
            )
    return out


# -- report --------------------------------------------------------------------------


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0].strip().replace("|", "/")[:300] if lines else ""


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


NAMES = {"mpar": "mpar", "torch": "torch DTensor TP", "deepspeed": "DeepSpeed AutoTP"}


def _markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    spec = meta["model"]
    lines = [
        "# Tensor-parallel benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['machine']}; {meta['threads']} thread(s) per rank; gloo on loopback; "
        f"tp = {meta['tp']} on {meta['tp']} processes (dp = pp = 1).",
        f"Versions: mpar {meta['mpar']}, torch {meta['torch']}, deepspeed {meta['deepspeed']}.",
        f"mpar imported from `{meta['mpar_source']}` (repository HEAD {meta['git_head']}).",
        f"Model: TinyGPT (fused_qkv=False) vocab {spec['vocab']}, d_model {spec['d_model']}, "
        f"{spec['num_layers']} blocks, {spec['num_heads']} heads, d_ffn {4 * spec['d_model']}, "
        f"{meta['parameters']:,} fp32 parameters; batch {spec['batch']} x seq {spec['seq']}; "
        f"AdamW. {meta['warmup']} warm-up + {meta['steps']} timed steps per job; samples/s "
        f"from the median step; {meta['rounds']} rounds, the engines' order alternating"
        f" ({len(next(iter(report['runs'].values()), []))} done).",
        "",
        "| engine | samples/s (median) | runs | step ms |",
        "|---|---:|---|---:|",
    ]
    for r in report["rows"]:
        name = NAMES[r["framework"]]
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']}: {_first_line(r.get('reason', ''))} | | |")
            continue
        runs = ", ".join(f"{s:.2f}" for s in r["samples_per_s_runs"])
        lines.append(f"| {name} | {r['samples_per_s']:.2f} | {runs} | {r['step_ms']:.0f} |")
    lines += ["", "| mpar / peer | median of per-round ratios | per round |", "|---|---:|---|"]
    for q in report["ratios"]:
        per = ", ".join(f"{v:.2f}" for v in q["per_round"])
        lines.append(f"| {NAMES[q['peer']]} | {q['ratio']:.2f} | {per} |")
    loads = [
        r["load_before"] for runs in report["runs"].values() for r in runs if "load_before" in r
    ]
    if loads:
        lines += [
            "",
            f"1-minute load average before each job: {min(loads):.1f} to {max(loads):.1f} "
            f"(median {statistics.median(loads):.1f}) on {os.cpu_count()} cores.",
        ]
    lines += [
        "",
        "Per rank, MiB: parameters and optimizer state (this rank's pieces), and RSS "
        "sampled every 2 ms during the timed steps (`MALLOC_MMAP_THRESHOLD_=65536`): "
        "baseline right before them, peak, and peak above baseline (medians over runs). "
        f"Counted from the sizes, each rank's parameters are "
        f"{_mib(meta['expected_local_parameter_bytes'])} MiB (the replicated ones whole, "
        "the split ones divided by tp).",
        "",
        "| engine | rank | parameters | optimizer | RSS baseline | RSS peak | step peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in report["rows"] if r["status"] == "ok"):
        for m in r["per_rank"]:
            lines.append(
                f"| {NAMES[r['framework']]} | {m['rank']} | {_mib(m['parameters'])} "
                f"| {_mib(m['optimizer'])} | {_mib(m['rss_baseline_bytes'])} "
                f"| {_mib(m['rss_peak_bytes'])} | {_mib(m['peak_above_baseline_bytes'])} |"
            )
    lines += [
        "",
        f"Warm-up losses against one process on the whole model (atol {TOLERANCE['atol']}, "
        f"rtol {TOLERANCE['rtol']}):",
        "",
        "| engine | losses | one process | first-step diff | max diff | agree |",
        "|---|---|---|---:|---:|---|",
    ]
    for c in report["sanity"]:
        losses = ", ".join(f"{v:.6f}" for v in c["losses"])
        ref = ", ".join(f"{v:.6f}" for v in c["reference"])
        lines.append(
            f"| {NAMES[c['framework']]} | {losses} | {ref} | {c['first_step_abs_diff']:.1e} "
            f"| {c['max_abs_diff']:.1e} | {'yes' if c['agree'] else '**no**'} |"
        )
    lines.append("")
    return "\n".join(lines)


def _meta(args: argparse.Namespace, spec: TPSpec) -> dict[str, Any]:
    import torch
    from _common import package_version
    from tp_peers.common import expected_local_parameters

    import mpar
    from mpar.testing.models import gpt_param_count

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
    ).stdout.strip()
    return {
        "command": "python benchmarks/tensor_parallel.py " + shlex.join(sys.argv[1:]),
        "mpar_source": str(Path(mpar.__file__).parent),
        "git_head": head,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "mpar": mpar.__version__,
        "torch": torch.__version__,
        "deepspeed": package_version("deepspeed"),
        "threads": args.threads,
        "tp": args.tp,
        "model": spec.__dict__,
        "parameters": gpt_param_count(spec.gpt_config()),
        "expected_local_parameter_bytes": 4 * expected_local_parameters(spec, args.tp),
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree = processes")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (losses checked)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per job")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke run")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 2, 2
        args.vocab, args.d_model, args.layers, args.heads, args.seq, args.batch = (
            64,
            32,
            2,
            4,
            16,
            4,
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(TPCase.from_json(args.worker), args.result)
        return 0
    spec = TPSpec(args.vocab, args.d_model, args.layers, args.heads, args.seq, args.batch)
    reference = _reference_losses(spec, args.warmup, args.threads)
    meta = _meta(args, spec)

    def write(runs: dict[str, list[dict[str, Any]]]) -> str:
        report = {
            "meta": meta,
            "rows": [_summarise(fw, spec, got) for fw, got in runs.items()],
            "ratios": _ratios(runs, spec),
            "sanity": _sanity(runs, reference),
            "runs": runs,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tensor_parallel.json").write_text(json.dumps(report, indent=1) + "\n")
        text = _markdown(report)
        (args.out / "tensor_parallel.md").write_text(text)
        return text

    print(write(_run_rounds(args, spec, write)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
