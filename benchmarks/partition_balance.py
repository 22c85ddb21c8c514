"""How well does the profiled partition balance a deliberately unbalanced model?

Model: token embedding (large vocabulary, many parameters, almost no compute),
8 transformer blocks, and a large-vocabulary LM head (most of the compute),
cut into 4 stages by:

* ``profile``     mpar's plan from measured unit times (``make_plan``, default
                  ``optimize="speed"`` unless ``--memory-weight`` is given);
* ``uniform``     equal numbers of units;
* ``parameters``  equal parameter counts (DeepSpeed's ``partition_method``);
* ``best``        brute force over every contiguous split, scored with the
                  measured unit times (the best achievable with these units).

Every split is then *measured*: ``split_module`` builds the stages and each
stage's forward+backward is timed on its real inputs (median of ``--repeats``).
The figure of merit is the slowest stage, which sets the pipeline's throughput.

    python benchmarks/partition_balance.py [--threads 1] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import torch

from mpar.config import config_from_dict
from mpar.partition import make_plan, plan_inputs, solve, split_module
from mpar.profile import profile_model
from mpar.testing.models import GPTConfig, TinyGPT

NUM_STAGES = 4


def _model(args: argparse.Namespace) -> tuple[TinyGPT, torch.Tensor]:
    cfg = GPTConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        num_layers=8,
        num_heads=8,
        d_ffn=4 * args.d_model,
        max_seq_len=args.seq,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    return TinyGPT(cfg), idx


def _time_stage(stage: torch.nn.Module, inputs: tuple[Any, ...], repeats: int) -> tuple[float, Any]:
    """Median forward+backward seconds of one stage; returns its (detached) outputs too."""

    def once() -> Any:
        leaves = tuple(
            x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
            for x in inputs
        )
        out = stage(*leaves)
        flat = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        torch.autograd.backward(flat, [torch.ones_like(t) for t in flat])
        return out

    out = once()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        samples.append(time.perf_counter() - start)
    stage.zero_grad(set_to_none=True)
    detached = (
        tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
        if isinstance(out, tuple)
        else out
    )
    return statistics.median(samples), detached


def _measure(model: TinyGPT, idx: torch.Tensor, boundaries: list[int], repeats: int) -> list[float]:
    split = split_module(model, (idx,), None, boundaries)
    times, inputs = [], (idx,)
    for stage in split.stages:
        seconds, inputs = _time_stage(stage, inputs, repeats)
        times.append(seconds)
    return times


def _brute_force(unit_times: list[float], k: int) -> list[int]:
    n = len(unit_times)
    best, best_cost = [0], float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        starts = [0, *cuts]
        cost = max(sum(unit_times[s:e]) for s, e in zip(starts, [*cuts, n]))
        if cost < best_cost:
            best, best_cost = starts, cost
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--memory-weight", type=float, default=None)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, idx = _model(args)

    start = time.perf_counter()
    profile = profile_model(model, (idx,), repeats=args.repeats, warmup=1)
    profile_s = time.perf_counter() - start
    unit_times = [u.time_s for u in profile.units]
    config = {"pipeline_parallel_degree": NUM_STAGES, "memory_weight": args.memory_weight}
    inputs = plan_inputs(config_from_dict(config), NUM_STAGES, device="cuda")
    plans = {
        method: make_plan(profile, inputs, method=method).boundaries
        for method in ("profile", "uniform", "parameters")
    }
    plans["best"] = _brute_force(unit_times, NUM_STAGES)

    rows = {}
    for name, bounds in plans.items():
        stage_times = _measure(model, idx, bounds, args.repeats)
        rows[name] = {
            "boundaries": bounds,
            "stage_ms": [t * 1e3 for t in stage_times],
            "max_ms": max(stage_times) * 1e3,
        }

    solver_s = _solver_speed()
    print(
        f"units ({len(profile.units)}): "
        + ", ".join(f"{u.name}={u.time_s * 1e3:.1f}ms" for u in profile.units)
    )
    print(
        f"profiling took {profile_s:.1f}s; solver 10,000 units into 64 stages: {solver_s * 1e3:.1f} ms\n"
    )
    best = rows["best"]["max_ms"]
    print(
        f"{'split':<11} {'boundaries':<16} {'stage ms (fwd+bwd, median)':<34} {'max ms':>8} {'vs best':>8}"
    )
    for name, row in rows.items():
        stages = " ".join(f"{t:7.1f}" for t in row["stage_ms"])
        print(
            f"{name:<11} {row['boundaries']!s:<16} {stages:<34} {row['max_ms']:8.1f} {row['max_ms'] / best:8.3f}"
        )
    ok = rows["profile"]["max_ms"] <= 1.10 * best
    print(f"\nprofiled plan within 10% of the best contiguous split: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"rows": rows, "solver_10k_64_s": solver_s, "threads": args.threads}, f, indent=2
            )


def _solver_speed() -> float:
    import random

    rng = random.Random(0)
    compute = [rng.uniform(0.1, 10.0) for _ in range(10_000)]
    start = time.perf_counter()
    solve(compute, 64)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
