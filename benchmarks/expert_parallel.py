"""Expert-parallel training: mpar at ep = world against the experts replicated (ep = 1,
ZeRO-3) and against DeepSpeed-MoE.

One GPT-style mixture-of-experts model (``ep_peers/common.py``: attention then an MoE
layer of ``--experts`` GELU MLPs, top-2, Mixtral's routing) is trained with AdamW on
``--world`` processes (gloo on loopback, dp = world, each rank its own fixed batch, one
intra-op thread per rank) by

* **mpar ep=W zero3**: ``expert_parallel_degree`` = world: each rank holds 1/W of the
  experts, tokens go to their experts' ranks in a dropless all-to-all; ZeRO-3 over dp
  for the rest;
* **mpar ep=1 zero3**: the same model with the experts replicated and sharded by
  ZeRO-3 (gathered for every forward and backward) — what mpar did before expert
  parallelism;
* **mpar ep=W** (ZeRO off) against **DeepSpeed-MoE** (``deepspeed.moe.layer.MoE``,
  ``ep_size`` = world, dropless, ZeRO off: DeepSpeed's MoE does not take ZeRO-3) where
  ``--deepspeed-python`` imports deepspeed; its row says why where it does not.

A round runs every engine once, the order alternating from round to round; ratios are
medians over rounds of the per-round samples/s ratios. Each job reports, per rank: the
expert parameter bytes it keeps between steps (from its tensors), the bytes its
all-to-alls sent to other ranks per step (mpar: ``TRAFFIC``; DeepSpeed: counted at
``all_to_all_single``), and for mpar the (token, expert) pairs routed and received:
their difference summed over the ranks is the tokens dropped. The measured all-to-all
bytes are set against the formula of docs/expert_parallel.md with routing spread
evenly. mpar's two rows also check their warm-up losses against one process on both
ranks' batches (fp32).

    python benchmarks/expert_parallel.py                      # world 2, 5 rounds
    python benchmarks/expert_parallel.py --deepspeed-python /path/to/venv/bin/python
    python benchmarks/expert_parallel.py --quick --out /tmp/ep   # smoke run
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import launch_job, round_ratios, run_rounds  # noqa: E402
from ep_peers.common import EPCase, EPSpec, a2a_formula  # noqa: E402

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


# -- worker side ---------------------------------------------------------------------


def _worker(case: EPCase, out: Path) -> None:
    import importlib

    impl = importlib.import_module(f"ep_peers.{case.framework}_ep")
    result = impl.run(case)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result))


# -- launching -----------------------------------------------------------------------


def _deepspeed_missing(python: str) -> str | None:
    """Why DeepSpeed-MoE cannot run with ``python``, or None."""
    probe = "from deepspeed.moe.layer import MoE"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["?"])[-1]
    return f"deepspeed.moe does not import with {python} ({last[:200]})"


def _cases(args: argparse.Namespace, spec: EPSpec) -> list[EPCase]:
    kw = {"world": args.world, "model": spec, "warmup": args.warmup, "steps": args.steps}
    cases = [EPCase("mpar", ep=args.world, zero=3, **kw), EPCase("mpar", ep=1, zero=3, **kw)]
    if "deepspeed" in args.frameworks:
        cases.append(EPCase("mpar", ep=args.world, zero=0, **kw))
        cases.append(EPCase("deepspeed", ep=args.world, zero=0, **kw))
    return cases


PAIRS = (("mpar ep={w} zero3", "mpar ep=1 zero3"), ("mpar ep={w}", "deepspeed ep={w}"))
"""The ratios reported: each pair differs in one thing (ep; the engine)."""


def _run_case(case: EPCase, args: argparse.Namespace) -> dict[str, Any]:
    worker = ["--worker", case.to_json()]
    python = args.deepspeed_python if case.framework == "deepspeed" else None
    load = os.getloadavg()[0]
    script = HERE / "expert_parallel.py"
    got = launch_job(
        case.framework, case.world, script, worker, args.threads, args.timeout,
        mmap_threshold=False, python=python,
    )  # fmt: skip
    got["load_before"] = load
    return got


def _run_rounds(args: argparse.Namespace, cases: list[EPCase]) -> dict[str, list[dict[str, Any]]]:
    by_name = {c.name: c for c in cases}
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    skip: dict[str, str | None] = {c.name: None for c in cases}
    for c in cases:
        if c.framework == "deepspeed":
            skip[c.name] = _deepspeed_missing(args.deepspeed_python)

    def shown(name: str, got: dict[str, Any]) -> str:
        tokens = by_name[name].world * by_name[name].model.tokens
        if got["status"] == "ok":
            return f"{tokens / got['median_step_s']:.0f} tokens/s (load {got['load_before']:.1f})"
        return f"{got['status']}: {got['reason'].strip().splitlines()[0][:200]}"

    def stop(name: str, r: int, got: dict[str, Any]) -> str | None:
        if got["status"] != "ok" and by_name[name].framework != "mpar":
            return f"failed in round {r + 1}: {got['reason']}"
        return None

    run_rounds(runs, args.rounds, lambda n: _run_case(by_name[n], args), shown, skip, stop)
    return runs


# -- reference and summaries ---------------------------------------------------------


def _reference_losses(spec: EPSpec, world: int, steps: int) -> list[float]:
    """One process, every rank's batch at once (the mean of equal means), AdamW."""
    import torch
    from ep_peers.common import MoEGPT, local_batch, loss_fn, make_optimizer

    torch.manual_seed(0)
    model = MoEGPT(spec)
    opt = make_optimizer(model.parameters())
    batches = [local_batch(spec, r) for r in range(world)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _summary(case: EPCase, runs: list[dict[str, Any]], reference: list[float]) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "framework": case.framework, "ep": case.ep}
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        row.update(status=runs[0]["status"] if runs else "skipped")
        row["reason"] = runs[0].get("reason", "") if runs else ""
        return row
    tokens = case.world * case.model.tokens
    per_rank = ok[0]["per_rank"]
    row.update(
        status="ok",
        tokens_per_s=statistics.median(tokens / r["median_step_s"] for r in ok),
        tokens_per_s_runs=[tokens / r["median_step_s"] for r in ok],
        step_ms=1000 * statistics.median(r["median_step_s"] for r in ok),
        expert_bytes=[p["expert_bytes"] for p in per_rank],
        a2a_bytes_per_step=[p["a2a_bytes_per_step"] for p in per_rank],
        warmup_losses=ok[0]["warmup_losses"],
    )
    if case.framework == "mpar":
        routed = sum(p["pairs_routed"] for p in per_rank)
        row["pairs_routed"], row["dropped"] = (
            routed,
            routed - sum(p["pairs_received"] for p in per_rank),
        )
        row["losses_agree"] = all(
            abs(a - b) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(b)
            for a, b in zip(row["warmup_losses"], reference, strict=False)
        )
    if case.ep > 1:
        formula = a2a_formula(case.model, case.ep)
        row["a2a_formula"] = formula
        row["a2a_vs_formula"] = [b / formula for b in row["a2a_bytes_per_step"]]
    return row


def _ratios(world: int, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The tokens/s ratio of each of :data:`PAIRS`, per round, and the median."""
    out = []
    for first, second in PAIRS:
        ours, other = first.format(w=world), second.format(w=world)
        if ours not in runs or other not in runs:
            continue
        per_round = round_ratios(runs[ours], runs[other])
        if per_round:
            out.append(
                {"ours": ours, "other": other, "ratio": statistics.median(per_round),
                 "per_round": per_round}
            )  # fmt: skip
    return out


# -- report --------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _markdown(report: dict[str, Any]) -> str:
    meta, spec = report["meta"], report["meta"]["model"]
    lines = [
        "# Expert-parallel benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['machine']}; {meta['threads']} thread(s) per rank; gloo on loopback; "
        f"{meta['world']} processes, dp = {meta['world']}, each rank its own batch of "
        f"{spec['batch']} x {spec['seq']} tokens.",
        f"Versions: torch {meta['torch']}, deepspeed {meta['deepspeed']}; mpar from "
        f"`{meta['mpar_source']}` (HEAD {meta['git_head']}).",
        f"Model: {spec['num_layers']} blocks of attention ({spec['num_heads']} heads, d_model "
        f"{spec['d_model']}) and an MoE layer of {spec['num_experts']} experts (d_expert "
        f"{spec['d_expert']}), top-{spec['top_k']}; vocab {spec['vocab']}; "
        f"{meta['expert_bytes'] / 2**20:.1f} MiB of expert parameters (fp32) in all. AdamW; "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps per job, tokens/s from the "
        f"median step; {meta['rounds']} rounds, the order alternating.",
        "",
        "| engine | tokens/s (median) | runs | step ms | expert MiB per rank | all-to-all MiB per "
        "step per rank (measured / even-routing formula) | pairs dropped |",
        "|---|---:|---|---:|---|---|---:|",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            reason = r.get("reason", "").strip().splitlines()
            lines.append(f"| {r['case']} | {r['status']}: {(reason or [''])[0][:200]} | | | | | |")
            continue
        runs = ", ".join(f"{v:.0f}" for v in r["tokens_per_s_runs"])
        experts = " / ".join(_mib(b) for b in r["expert_bytes"])
        a2a = " / ".join(_mib(b) for b in r["a2a_bytes_per_step"])
        if "a2a_vs_formula" in r:
            a2a += f" ({', '.join(f'{v:.3f}' for v in r['a2a_vs_formula'])} x formula)"
        dropped = r.get("dropped", "n/a")
        lines.append(
            f"| {r['case']} | {r['tokens_per_s']:.0f} | {runs} | {r['step_ms']:.0f} | {experts} "
            f"| {a2a} | {dropped} |"
        )
    lines += ["", "| ratio (tokens/s) | median of per-round ratios | per round |", "|---|---:|---|"]
    for q in report["ratios"]:
        per = ", ".join(f"{v:.2f}" for v in q["per_round"])
        lines.append(f"| {q['ours']} / {q['other']} | {q['ratio']:.2f} | {per} |")
    lines += ["", "Warm-up losses (mpar) against one process on every rank's batch:", ""]
    for r in report["rows"]:
        if r.get("framework") == "mpar" and r["status"] == "ok":
            losses = ", ".join(f"{v:.6f}" for v in r["warmup_losses"])
            agree = "agree" if r["losses_agree"] else "**differ**"
            lines.append(f"- {r['case']}: {losses} ({agree})")
    ref = ", ".join(f"{v:.6f}" for v in report["reference_losses"])
    lines += [f"- one process: {ref}", ""]
    return "\n".join(lines)


def _meta(args: argparse.Namespace, spec: EPSpec) -> dict[str, Any]:
    import dataclasses

    import torch

    import mpar

    head = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    ds = subprocess.run(
        [args.deepspeed_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    ).stdout.strip().splitlines()  # fmt: skip
    return {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "world": args.world,
        "torch": torch.__version__,
        "deepspeed": ds[-1] if ds else "not installed",
        "mpar_source": str(Path(mpar.__file__).parent),
        "git_head": head,
        "model": dataclasses.asdict(spec),
        "expert_bytes": spec.expert_parameters() * 4,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--frameworks", nargs="+", default=["mpar", "deepspeed"])
    parser.add_argument("--deepspeed-python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round (smoke run)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "expert_parallel")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(EPCase.from_json(args.worker), args.result)
        return
    spec = EPSpec(num_layers=args.layers, num_experts=args.experts, batch=args.batch)
    if args.quick:
        spec = EPSpec(d_model=32, d_expert=64, num_layers=2, num_experts=4, seq=16, batch=4)
        args.rounds, args.warmup, args.steps = 1, 2, 2
    cases = _cases(args, spec)
    runs = _run_rounds(args, cases)
    reference = _reference_losses(spec, args.world, args.warmup)
    report = {
        "meta": _meta(args, spec),
        "rows": [_summary(c, runs[c.name], reference) for c in cases],
        "ratios": _ratios(args.world, runs),
        "reference_losses": reference,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "expert_parallel.json").write_text(json.dumps(report, indent=1))
    text = _markdown(report)
    (args.out / "expert_parallel.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
