"""The cost of the split backward on one pipeline stage, in one process.

Zero-bubble schedules split a stage's backward into I (input gradients) and W
(the linear layers' weight gradients, ``mpar.runtime._split_backward``). This
times, for one stage of the pipeline benchmark's model (4 blocks, head and loss,
d=128, a microbatch of 8 x 32, one thread), the forward and the backward done
the ordinary way (F + B) and split (F + I + W), interleaved iteration by
iteration so both see the same load, and checks that the gradients agree::

    python benchmarks/split_backward.py [--iters 200] [--d-model 128] [--out DIR]

``--d-model 16 --vocab 64 --batch 2 --seq 4`` leaves the per-layer overhead alone
(the matrix products become negligible). Figures are the 10th percentile of the
iterations (the machine is shared; the low end is the least disturbed).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from _common import ModelSpec, loss_fn, make_layers
from torch import nn

from mpar.runtime._split_backward import defer_weight_gradients, split_backward


def _timed(stage: nn.Module, x0: torch.Tensor, target: torch.Tensor, split: bool) -> list[float]:
    for p in stage.parameters():
        p.grad = None
    x = x0.detach().requires_grad_()
    t0 = time.perf_counter()
    loss = loss_fn(stage(x), target)
    t1 = time.perf_counter()
    if split:
        weights = split_backward([loss], None, (x,))
        t2 = time.perf_counter()
        weights()
    else:
        loss.backward()
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="microbatch size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = ModelSpec(
        vocab=args.vocab, d_model=args.d_model, num_layers=8, num_heads=4, seq=args.seq
    )
    plain = nn.Sequential(*make_layers(spec)[5:])  # the last stage of a 2-way uniform split
    split = copy.deepcopy(plain)
    layers = defer_weight_gradients(split)
    torch.manual_seed(1)
    x0 = torch.randn(args.batch, args.seq, args.d_model)
    target = torch.randint(0, args.vocab, (args.batch, args.seq))
    stages = {"F + B": (plain, False), "F + I + W": (split, True)}
    times: dict[str, list[list[float]]] = {name: [] for name in stages}
    for i in range(args.iters + 10):
        for name, (stage, is_split) in stages.items():
            got = _timed(stage, x0, target, is_split)
            if i >= 10:
                times[name].append(got)
    want = dict(plain.named_parameters())  # the last iteration's gradients agree
    for name, param in split.named_parameters():
        torch.testing.assert_close(param.grad, want[name].grad, msg=name)
    result = {"layers_deferred": layers, "args": vars(args) | {"out": str(args.out)}}
    print(
        f"one stage: 4 blocks + head + loss, d={args.d_model}, microbatch "
        f"{args.batch}x{args.seq}, {layers} linear layers deferred; ms, 10th percentile"
    )
    for name, rows in times.items():
        phases = [1e3 * sorted(r[k] for r in rows)[len(rows) // 10] for k in range(3)]
        result[name] = {"forward": phases[0], "backward_or_I": phases[1], "W": phases[2]}
        print(
            f"  {name:10s} F {phases[0]:7.3f}  B/I {phases[1]:7.3f}  W {phases[2]:7.3f}  "
            f"sum {sum(phases):7.3f}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "split_backward.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
