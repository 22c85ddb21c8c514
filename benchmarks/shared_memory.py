"""Pipeline transfers through shared memory against the same transfers through gloo.

One job of the pipeline benchmark's model (p=2, 8 blocks, d=128, batch 32 x seq 32,
SGD, one thread per rank; ``mpar.init`` with ``shared_memory`` on) switches its
transfers between the shared-memory rings and gloo every ``--block`` steps, at step
boundaries where no transfer is in flight, so both transports run in the same
processes, on the same memory and under the same load, alternating block by block::

    python benchmarks/shared_memory.py [--microbatches 8] [--blocks 60] [--block 5]
        [--schedule zero_bubble] [--out DIR]

Reported: each transport's median step time (rank 0's wall time per step) and gloo's
over the rings'. Whole-run benchmarks (``pipeline.py``'s ``+backend`` rows) alternate
whole jobs instead, whose spread on a shared machine (0.75-1.35 per round) hides a
difference of a few percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import Case, ModelSpec, global_batch, loss_fn, make_optimizer, set_threads
from _harness import launch_job

HERE = Path(__file__).resolve().parent


def _worker(args: argparse.Namespace) -> None:
    from peers import mpar_pipe

    import mpar
    from mpar.comm import state

    spec = ModelSpec(seq=args.seq, microbatches=args.microbatches)
    case = Case("mpar", args.schedule, 2, 1, 1, spec, 3, args.block, "uniform")
    mpar.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": args.microbatches,
            **mpar_pipe._schedule_keys(case),
        }
    )
    set_threads()
    model = mpar.DistributedModel(mpar_pipe._sequential(case))
    opt = mpar.DistributedOptimizer(make_optimizer(model.parameters()))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    x, y = global_batch(spec)
    links = state().p2p_links
    rings = links.shared
    if rings is None:
        raise SystemExit("no shared-memory rings between the two ranks on this host")
    modes = {"rings": rings, "gloo": None}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for block in range(-2, args.blocks):  # two blocks of warm-up, one of each
        name = list(modes)[block % 2]
        links.shared = modes[name]
        mpar.barrier()
        for _ in range(args.block):
            start = time.perf_counter()
            train(model, x, y)
            opt.step()
            opt.zero_grad()
            if block >= 0:
                times[name].append(time.perf_counter() - start)
    links.shared = rings
    if mpar.rank() == 0 and args.result:
        medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        Path(args.result).write_text(
            json.dumps({"median_step_ms": medians, "steps": {n: len(t) for n, t in times.items()}})
        )
    mpar.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--schedule", default="zero_bubble")
    p.add_argument("--blocks", type=int, default=60, help="blocks of steps, alternating")
    p.add_argument("--block", type=int, default=5, help="steps per block")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    worker = [
        "--worker",
        f"--microbatches={args.microbatches}",
        f"--seq={args.seq}",
        f"--schedule={args.schedule}",
        f"--blocks={args.blocks}",
        f"--block={args.block}",
    ]
    got = launch_job("mpar", 2, Path(__file__), worker, 1, args.timeout, mmap_threshold=False)
    if got["status"] != "ok":
        print(got["reason"], file=sys.stderr)
        return 1
    ms = got["median_step_ms"]
    ratio = ms["gloo"] / ms["rings"]
    line = (
        f"{args.schedule}, m={args.microbatches}: median step {ms['rings']:.1f} ms through "
        f"shared memory, {ms['gloo']:.1f} ms through gloo ({got['steps']['rings']} steps "
        f"each); gloo / rings = {ratio:.3f}"
    )
    print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"shared_memory_{args.schedule}_m{args.microbatches}.json"
        (args.out / name).write_text(
            json.dumps(
                {**got, "ratio": ratio, "args": {k: str(v) for k, v in vars(args).items()}},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
