"""Pipeline peak memory against the number of microbatches (issue 44, acceptance).

A step of a 1F1B-family schedule has at most about ``p`` microbatches in flight on a
rank, so its peak memory must not grow with the number of microbatches ``m`` beyond
that bound: activations are freed after their backward, received messages when
consumed, sent messages once their send is done (``mpar.comm._p2p.PendingSends``).
This runs p = 2, 1F1B (``pipeline: "interleaved"``, one virtual stage), one MLP block
per stage (64 -> 1024 -> 64, residual: it saves about 16 MiB per microbatch for
backward), the same microbatch size (8 x 512 x 64 fp32: every boundary activation and
gradient message is 1 MiB), at m = 8, 32 and 128, and reports each rank's step peak as DESIGN.md
measures peaks on the CPU: RSS sampled every 2 ms with ``MALLOC_MMAP_THRESHOLD_``
at 64 KiB (freed tensors leave RSS at once), above the RSS right before the timed
steps; and the most messages a rank held at a send.

    python benchmarks/pipeline_memory.py             # writes results/pipeline_memory.json

Acceptance: the peak at m = 128 within 10 % of m = 8. A benchmark: nothing asserts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from mpar.testing import run_distributed  # noqa: E402 (the checkout first on the path)

H, MICROBATCH, SEQ = 64, 8, 512
MIB = 2**20


def _block() -> Any:
    """An MLP block (H -> 16 H -> H) with a residual: it saves about 16 messages' worth of
    activations per microbatch for backward, as a transformer block saves many times its
    boundary tensor."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(H, 16 * H), nn.Linear(16 * H, H)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.tanh(self.up(x)))

    return Block()


def _body(microbatches: list[int], steps: int) -> list[dict[str, Any]]:
    import torch
    from torch import nn

    import mpar
    from mpar.comm import _p2p
    from mpar.testing.rss import RssPeak

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD_, set in this process
    held: list[int] = []
    add = _p2p.PendingSends.add

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        add(self, *args, **kwargs)
        held.append(len(self.buffers))

    _p2p.PendingSends.add = counting  # type: ignore[method-assign]
    out = []
    for m in microbatches:
        mpar.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "interleaved"})
        torch.manual_seed(0)
        net = nn.Sequential(*[_block() for _ in range(2)])  # one block per stage
        model = mpar.DistributedModel(net)
        opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

        @mpar.step
        def train(mdl: Any, x: Any) -> Any:
            loss = mdl(x).square().mean()
            mdl.backward(loss)
            return loss

        x = torch.randn(m * MICROBATCH, SEQ, H)
        train(model, x)  # partition, agreement of the transfers, warm caches
        opt.step()
        opt.zero_grad()
        held.clear()
        started = time.perf_counter()
        with RssPeak() as rss:
            base = rss.reset()
            for _ in range(steps):
                train(model, x)
                opt.step()
                opt.zero_grad()
        seconds = (time.perf_counter() - started) / steps
        out.append(
            {
                "microbatches": m,
                "peak_above_baseline_mib": (rss.peak - base) / MIB,
                "most_messages_held": max(held, default=0),
                "messages_sent_per_step": len(held) / steps,
                "step_s": seconds,
            }
        )
        mpar.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case")
    parser.add_argument("--name", default="pipeline_memory")
    args = parser.parse_args(argv)
    ranks = run_distributed(_body, 2, args=(args.microbatches, args.steps), timeout=3000)
    rows = []
    for i, m in enumerate(args.microbatches):
        peaks = [r[i]["peak_above_baseline_mib"] for r in ranks]
        held = [r[i]["most_messages_held"] for r in ranks]
        rows.append({"microbatches": m, "peak_mib_per_rank": peaks, "messages_held": held,
                     "step_s": ranks[0][i]["step_s"]})  # fmt: skip
        print(f"m={m:4d}  peak above baseline per rank (MiB) {[f'{p:.1f}' for p in peaks]}  "
              f"most messages held {held}  step {ranks[0][i]['step_s']:.2f} s", flush=True)  # fmt: skip
    first = rows[0]["peak_mib_per_rank"]
    for row in rows[1:]:
        ratios = [p / f if f else float("nan") for p, f in zip(row["peak_mib_per_rank"], first)]
        row["ratio_to_first"] = ratios
        print(f"m={row['microbatches']} / m={rows[0]['microbatches']}: "
              f"{[f'{r:.3f}' for r in ratios]}")  # fmt: skip
    result = {
        "setup": {
            "pp": 2,
            "schedule": "1F1B (interleaved, v=1)",
            "microbatch": [MICROBATCH, SEQ, H],
            "message_mib": MICROBATCH * SEQ * H * 4 / MIB,
            "steps": args.steps,
            "peak": "RSS sampled every 2 ms, MALLOC_MMAP_THRESHOLD_=65536, above the "
            "RSS right before the timed steps",
        },
        "rows": rows,
    }
    out = HERE / "results" / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
