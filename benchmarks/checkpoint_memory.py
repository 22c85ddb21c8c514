"""Peak memory of a checkpoint save against the training peak, per rank.

Issue 16 asks that no rank holds more than its own shards plus one DCP write
buffer while it saves. Each rank trains a model of ``--layers`` Linear layers
(``--width`` squared weights: 16 x 1024^2 = 67 MB of fp32 parameters by
default) with AdamW at the given ZeRO stage, while a thread samples the
process's resident set (``/proc/self/statm``) every 2 ms; glibc is told to
return freed blocks of 64 KiB and more to the system at once (``mallopt``, the
same as ``MALLOC_MMAP_THRESHOLD_=65536``), so RSS follows what is held. It
reports, per rank: the peak over the training steps, the peak during a
synchronous ``save_checkpoint`` and during an asynchronous one (``async_save``
copies the rank's shards to host memory first, by design), and the resident
size just before each save::

    python benchmarks/checkpoint_memory.py                      # dp 2, ZeRO-3
    python benchmarks/checkpoint_memory.py --zero 1 --pp 2 --world 4

Results go to ``benchmarks/results/checkpoint_memory_<layout>.json`` (and stdout as a
markdown table). A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from mpar.testing import run_distributed
from mpar.testing.rss import RssPeak

M_MMAP_THRESHOLD = -3


def _take(sampler: RssPeak) -> int:
    """The window's peak, once the sampler has seen the last few milliseconds."""
    time.sleep(3 * sampler.interval)
    return max(sampler.peak, sampler.now())


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def _rank(
    config: dict[str, Any], layers: int, width: int, steps: int, root: str, buffer_mb: float
) -> dict[str, Any]:
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    import mpar
    import mpar.checkpoint._save

    mpar.checkpoint._save.WRITE_BUFFER_BYTES = int(buffer_mb * 2**20)
    mpar.init(config)
    model = mpar.DistributedModel(_model(layers, width))
    opt = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @mpar.step
    def train(m: Any, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).square().mean()
        m.backward(loss)
        return loss

    x = torch.randn(8 * mpar.config().microbatches, width)
    out: dict[str, Any] = {"rank": mpar.rank()}
    with RssPeak() as sampler:
        train(model, x)  # the first step partitions and profiles: not counted
        opt.step()
        opt.zero_grad()
        out["rss_between_steps"] = sampler.reset()
        for _ in range(steps):
            train(model, x)
            opt.step()
            opt.zero_grad()
        out["peak_train"] = _take(sampler)
        out["rss_before_save"] = sampler.reset()
        mpar.save_checkpoint(root, model, opt)
        out["peak_save"] = _take(sampler)
        out["rss_before_async_save"] = sampler.reset()
        mpar.save_checkpoint(root, model, opt, async_save=True).wait()
        out["peak_async_save"] = _take(sampler)
        out["memory_report"] = mpar.memory_report()
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    mb = 2**20
    lines = [
        "| rank | between steps | training peak | before save | save peak | save / train |"
        " async save peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rank']} | {r['rss_between_steps'] / mb:.0f} MB | {r['peak_train'] / mb:.0f} MB"
            f" | {r['rss_before_save'] / mb:.0f} MB | {r['peak_save'] / mb:.0f} MB"
            f" | {r['peak_save'] / r['peak_train']:.3f} | {r['peak_async_save'] / mb:.0f} MB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--buffer-mb",
        type=float,
        default=32,
        help="tensor bytes per shard file (mpar's default 32; a huge value gives DCP's "
        "one file per rank, whose tensor copies are all held until the file is written)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    config = {
        "pipeline_parallel_degree": args.pp,
        "microbatches": max(1, args.pp),
        "zero": {"stage": args.zero},
    }
    with tempfile.TemporaryDirectory() as root:
        rows = run_distributed(
            _rank,
            args.world,
            args=(config, args.layers, args.width, args.steps, root, args.buffer_mb),
            timeout=900,
            env={"MALLOC_MMAP_THRESHOLD_": "65536"},
        )
    params_mb = args.layers * (args.width + 1) * args.width * 4 / 2**20
    report = {
        "config": config,
        "world": args.world,
        "parameters_mb": params_mb,
        "buffer_mb": args.buffer_mb,
        "ranks": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layout = f"pp{args.pp}_dp{args.world // args.pp}_zero{args.zero}"
    buffer = "" if args.buffer_mb == 32 else f"_buffer{args.buffer_mb:g}mb"
    name = f"checkpoint_memory_{layout}{buffer}.json"
    (out / name).write_text(json.dumps(report, indent=1))
    print(
        f"{params_mb:.0f} MB of fp32 parameters, {config}, world {args.world}, "
        f"write buffer {args.buffer_mb:g} MB\n"
    )
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
