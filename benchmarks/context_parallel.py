"""Context parallelism: throughput, per-rank peak memory and the longest trainable sequence.

One GPT-style model (``benchmarks/cp_peers/common.py``: its attention one causal
``scaled_dot_product_attention`` call) trains with SGD on one fixed long sequence per
sample, one intra-op thread per rank, gloo on loopback, at ``--cp`` on ``--cp``
processes (dp = pp = tp = 1), by

* mpar, ring: ``{"context_parallel_degree": cp}`` (``mpar launch``);
* mpar, all-to-all: ``{"context_parallel_method": "all_to_all"}``;
* DeepSpeed Ulysses: ``deepspeed.sequence.layer.DistributedAttention`` around the same
  attention call, each rank feeding its contiguous share of the sequence, the DeepSpeed
  engine averaging the gradients (``torchrun``, from ``--peers-python``: DeepSpeed lives
  in its own virtual environment, see benchmarks/README.md);
* torch: ``torch.distributed.tensor.experimental.context_parallel`` around each step,
  where it runs; where not, its row says why.

**Throughput** (``--seqs``): each job runs ``--warmup`` steps (losses kept and compared
with one process on the whole sequence), then ``--steps`` timed steps between barriers,
every rank sampling its RSS every 2 ms (``MALLOC_MMAP_THRESHOLD_=65536``). A round runs
every engine once, the order alternating; ratios are medians over rounds of mpar / peer
tokens/s within a round (DESIGN.md, performance method).

**Longest sequence** (``--cap-mib``): per engine and cp in ``--longest-cps``, one job
trains one step at each of ``--longest-step`` x 1, 2, 3, ... tokens (after a warm-up
step at that length) until a rank's peak RSS above its baseline passes the cap; the
longest length within the cap is reported, and its ratio to mpar at cp 1 (one process,
no context parallelism).

    python benchmarks/context_parallel.py                          # cp 2, 5 rounds
    python benchmarks/context_parallel.py --seqs 4096 8192 --rounds 7 --cap-mib 192
    python benchmarks/context_parallel.py --quick --out /tmp/cp     # smoke run
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import launch_job, round_ratios, run_rounds  # noqa: E402
from cp_peers.common import CPCase, CPSpec  # noqa: E402

ENGINES = ("mpar:ring", "mpar:all_to_all", "deepspeed:ulysses", "torch:context_parallel")
NAMES = {
    "mpar:ring": "mpar ring",
    "mpar:all_to_all": "mpar all-to-all",
    "deepspeed:ulysses": "DeepSpeed Ulysses",
    "torch:context_parallel": "torch context_parallel",
}
PEERS_PYTHON = "/work/venv-peers/bin/python"
TOLERANCE = 2e-4
"""Relative agreement of the warm-up losses with one process on the whole sequence."""


# -- worker side ---------------------------------------------------------------------


def _worker(case: CPCase, out: Path) -> None:
    import importlib

    module = {"mpar": "mpar_cp", "deepspeed": "deepspeed_cp", "torch": "torch_cp"}
    impl = importlib.import_module(f"cp_peers.{module[case.framework]}")
    result = impl.run(case)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result))


# -- launching -----------------------------------------------------------------------


def _python(args: argparse.Namespace, framework: str) -> str | None:
    """The interpreter of ``framework``'s jobs, or None when it is not installed there."""
    python = args.peers_python if framework == "deepspeed" else sys.executable
    module = {"deepspeed": "deepspeed", "torch": "torch.distributed.tensor.experimental"}
    probe = f"import {module.get(framework, 'mpar')}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    ok = subprocess.run([python, "-c", probe], capture_output=True, env=env, timeout=300)
    return python if ok.returncode == 0 else None


def _job(args: argparse.Namespace, case: CPCase, python: str) -> dict[str, Any]:
    """One job of ``case``, started again once if it fails (a port taken, say)."""
    worker = ["--worker", case.to_json()]
    load = os.getloadavg()[0]
    script = HERE / "context_parallel.py"
    run = (case.framework, case.cp, script, worker, args.threads, args.timeout)
    got = launch_job(*run, python=python)
    if got["status"] != "ok":
        first = got["reason"]
        print(f"  failed, once more: {_first_line(first)}", file=sys.stderr, flush=True)
        got = launch_job(*run, python=python)
        got["first_failure"] = first
    if got.get("unsupported"):
        got = {"status": "unsupported", "reason": got["unsupported"]}
    got["load_before"] = load
    return got


def _engines(args: argparse.Namespace) -> dict[str, str | None]:
    pythons = {fw: _python(args, fw) for fw in {e.split(":")[0] for e in args.engines}}
    return {e: pythons[e.split(":")[0]] for e in args.engines}


def _throughput(args: argparse.Namespace, spec: CPSpec, pythons: dict[str, str | None],
                write: Any, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> None:  # fmt: skip
    """Per sequence length: ``args.rounds`` rounds of one job per engine, into ``runs``."""
    for seq in args.seqs:
        at = CPSpec(**{**spec.__dict__, "seq": seq})
        mine = runs.setdefault(str(seq), {e: [] for e in args.engines})
        skip: dict[str, str | None] = {
            e: None if pythons[e] else "not installed" for e in args.engines
        }

        def one(engine: str, at: CPSpec = at) -> dict[str, Any]:
            fw, method = engine.split(":")
            case = CPCase(fw, method, args.cp, at, args.warmup, args.steps)
            return _job(args, case, pythons[engine] or sys.executable)

        run_rounds(
            mine, args.rounds, one, lambda _e, got, at=at: _shown(got, at), skip,
            _peer_failed,
            prefix=f"seq {seq} ", after_round=write,
        )  # fmt: skip


def _peer_failed(engine: str, _round: int, got: dict[str, Any]) -> str | None:
    """A peer that failed is skipped in later rounds (mpar is run again)."""
    return got["reason"] if got["status"] != "ok" and not engine.startswith("mpar:") else None


def _longest(args: argparse.Namespace, spec: CPSpec, pythons: dict[str, str | None],
             write: Any, out: list[dict[str, Any]]) -> None:  # fmt: skip
    """Per engine and cp: the lengths tried and their per-rank peaks, into ``out``."""
    cap = int(args.cap_mib * 2**20)
    steps = range(1, args.longest_max // args.longest_step + 1)
    lengths = tuple(args.longest_step * k for k in steps)
    jobs = [("mpar:ring", 1)] + [(e, cp) for cp in args.longest_cps for e in args.engines if cp > 1]
    for engine, cp in jobs:
        if pythons[engine] is None:
            continue
        fw, method = engine.split(":")
        fit = tuple(n for n in lengths if n % (2 * cp) == 0)
        case = CPCase(fw, method, cp, spec, 0, 0, fit, cap)
        got = _job(args, case, pythons[engine] or sys.executable)
        row: dict[str, Any] = {"engine": engine if cp > 1 else "one process", "cp": cp, **got}
        if got["status"] == "ok":
            within = [t["seq"] for t in got["longest"] if t["peak_above_baseline_bytes"] <= cap]
            row["longest_seq"] = max(within, default=0)
        out.append(row)
        print(f"[longest] {row['engine']} cp {cp}: {row.get('longest_seq', got.get('reason'))}",
              flush=True)  # fmt: skip
        write()


# -- summaries -----------------------------------------------------------------------


def _shown(got: dict[str, Any], spec: CPSpec) -> str:
    if got["status"] != "ok":
        return f"{got['status']}: {_first_line(got.get('reason', ''))}"
    tokens = spec.batch * spec.seq / got["median_step_s"]
    return f"{tokens:.0f} tokens/s (load {got['load_before']:.1f})"


def _first_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[0].strip().replace("|", "/")[:300] if lines else ""


def _rows(seq: int, spec: CPSpec, runs: dict[str, list[dict[str, Any]]],
          reference: list[float]) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for engine, got in runs.items():
        ok = [r for r in got if r["status"] == "ok"]
        row: dict[str, Any] = {"engine": engine, "seq": seq}
        if not ok:
            row.update(status=got[0]["status"] if got else "skipped")
            row["reason"] = got[0].get("reason", "") if got else ""
            rows.append(row)
            continue
        tokens = [spec.batch * seq / r["median_step_s"] for r in ok]
        peaks = [max(p["peak_above_baseline_bytes"] for p in r["peak_per_rank"]) for r in ok]
        losses = ok[0]["warmup_losses"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=False))
        row.update(
            status="ok",
            tokens_per_s=statistics.median(tokens),
            tokens_per_s_runs=tokens,
            peak_mib=statistics.median(peaks) / 2**20,
            losses=losses,
            reference=reference[: len(losses)],
            max_rel_loss_diff=diff,
            agree=diff <= TOLERANCE,
            activations_mib=[a / 2**20 for a in ok[0].get("activations_per_rank", [])],
        )
        rows.append(row)
    return rows


def _ratios(seq: int, spec: CPSpec, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    peer = runs.get("deepspeed:ulysses", [])
    for engine in ("mpar:ring", "mpar:all_to_all"):
        per_round = round_ratios(runs.get(engine, []), peer)
        if per_round:
            out.append({"seq": seq, "engine": engine, "ratio": statistics.median(per_round),
                        "per_round": per_round})  # fmt: skip
    return out


def _markdown(report: dict[str, Any]) -> str:
    meta, spec = report["meta"], report["meta"]["model"]
    lines = [
        "# Context-parallel benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['machine']}; {meta['threads']} thread(s) per rank; gloo on loopback; "
        f"cp = {meta['cp']} on {meta['cp']} processes (dp = pp = tp = 1). Versions: mpar "
        f"{meta['mpar']}, torch {meta['torch']}, deepspeed {meta['deepspeed']}. Model: "
        f"d_model {spec['d_model']}, {spec['num_layers']} blocks, {spec['num_heads']} heads, "
        f"vocab {spec['vocab']}, batch {spec['batch']}; SGD. {meta['warmup']} warm-up + "
        f"{meta['steps']} timed steps per job; {meta['rounds']} rounds, order alternating.",
        "",
        "| seq | engine | tokens/s (median) | runs | peak MiB / rank | losses = 1 process |",
        "|---:|---|---:|---|---:|---|",
    ]
    for r in report["rows"]:
        name = NAMES[r["engine"]]
        if r["status"] != "ok":
            lines.append(f"| {r['seq']} | {name} | {r['status']}: {_first_line(r['reason'])} "
                         "| | | |")  # fmt: skip
            continue
        runs = ", ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"])
        agree = "yes" if r["agree"] else f"**no** ({r['max_rel_loss_diff']:.1e})"
        lines.append(f"| {r['seq']} | {name} | {r['tokens_per_s']:.0f} | {runs} "
                     f"| {r['peak_mib']:.1f} | {agree} |")  # fmt: skip
    lines += ["", "| seq | mpar / DeepSpeed Ulysses | median of per-round ratios | per round |",
              "|---:|---|---:|---|"]  # fmt: skip
    for q in report["ratios"]:
        per = ", ".join(f"{v:.2f}" for v in q["per_round"])
        lines.append(f"| {q['seq']} | {NAMES[q['engine']]} | {q['ratio']:.2f} | {per} |")
    if report["longest"]:
        lines += ["", f"Longest sequence within {meta['cap_mib']} MiB of step peak per rank "
                  f"(lengths in steps of {meta['longest_step']}):", "",
                  "| engine | cp | longest seq | x one process | peaks MiB (seq) |",
                  "|---|---:|---:|---:|---|"]  # fmt: skip
        base = next((r.get("longest_seq") for r in report["longest"] if r["cp"] == 1), None)
        for r in report["longest"]:
            name = NAMES.get(r["engine"], r["engine"])
            if r["status"] != "ok":
                lines.append(f"| {name} | {r['cp']} | {r['status']}: "
                             f"{_first_line(r.get('reason', ''))} | | |")  # fmt: skip
                continue
            times = f"{r['longest_seq'] / base:.2f}" if base else "-"
            tried = ", ".join(f"{t['peak_above_baseline_bytes'] / 2**20:.0f} ({t['seq']})"
                              for t in r["longest"])  # fmt: skip
            lines.append(f"| {name} | {r['cp']} | {r['longest_seq']} | {times} | {tried} |")
    loads = [r["load_before"] for rs in report["runs"].values() for g in rs.values() for r in g
             if "load_before" in r]  # fmt: skip
    if loads:
        lines += ["", f"1-minute load average before each job: {min(loads):.1f} to "
                  f"{max(loads):.1f} (median {statistics.median(loads):.1f}) on "
                  f"{os.cpu_count()} cores."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _meta(args: argparse.Namespace, spec: CPSpec) -> dict[str, Any]:
    import torch
    from _common import package_version

    import mpar

    def peer_version() -> str:
        probe = "import importlib.metadata as m; print(m.version('deepspeed'))"
        got = subprocess.run([args.peers_python, "-c", probe], capture_output=True, text=True)
        return got.stdout.strip() or package_version("deepspeed")

    return {
        "command": "python benchmarks/context_parallel.py " + shlex.join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "mpar": mpar.__version__,
        "torch": torch.__version__,
        "deepspeed": peer_version() if Path(args.peers_python).exists() else "not installed",
        "threads": args.threads,
        "cp": args.cp,
        "model": spec.__dict__,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "cap_mib": args.cap_mib,
        "longest_step": args.longest_step,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree = processes")
    p.add_argument("--seqs", nargs="+", type=int, default=[4096, 8192], help="tokens/sequence")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (losses checked)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per job")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cap-mib", type=float, default=256.0, help="per-rank step peak cap")
    p.add_argument("--longest-cps", nargs="*", type=int, default=[2, 4])
    p.add_argument("--longest-step", type=int, default=1024, help="length increment")
    p.add_argument("--longest-max", type=int, default=65536)
    p.add_argument("--peers-python", default=PEERS_PYTHON, help="DeepSpeed's interpreter")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 round: a smoke run")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.steps, args.seqs = 1, 2, 1, [256]
        args.d_model, args.layers, args.heads, args.vocab = 32, 2, 4, 64
        args.cap_mib, args.longest_step, args.longest_max, args.longest_cps = 8.0, 256, 1024, [2]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(CPCase.from_json(args.worker), args.result)
        return 0
    from cp_peers.common import reference_losses

    spec = CPSpec(args.vocab, args.d_model, args.layers, args.heads, args.seqs[0], args.batch)
    meta = _meta(args, spec)
    pythons = _engines(args)
    state: dict[str, Any] = {"runs": {}, "longest": []}

    def write() -> str:
        rows, ratios = [], []
        for seq, runs in state["runs"].items():
            at = CPSpec(**{**spec.__dict__, "seq": int(seq)})
            if seq not in references:
                references[seq] = reference_losses(at, args.warmup)
            rows += _rows(int(seq), at, runs, references[seq])
            ratios += _ratios(int(seq), at, runs)
        report = {"meta": meta, "rows": rows, "ratios": ratios, "longest": state["longest"],
                  "runs": state["runs"]}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "context_parallel.json").write_text(json.dumps(report, indent=1) + "\n")
        text = _markdown(report)
        (args.out / "context_parallel.md").write_text(text)
        return text

    references: dict[str, list[float]] = {}
    _throughput(args, spec, pythons, write, state["runs"])
    if args.longest_cps:
        _longest(args, spec, pythons, write, state["longest"])
    print(write())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
