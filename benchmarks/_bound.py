"""The simulated bound: layer costs measured here, fed to ``mpar.schedule.simulate``.

:func:`measure` times forward and backward of one microbatch through every
layer (rounds over all layers, medians), and the optimizer step per parameter,
in one process with the benchmark's thread count. :func:`bound` sums the layer
costs into the stages of the uniform split and simulates the schedule with no
communication cost and no runtime overhead: the step time a pipeline runtime
could reach with these kernels. ``bound / measured`` is the schedule
efficiency. (The ranks of a real run share the machine's caches and memory
bandwidth, which a single process measuring alone does not, so the bound is
slightly optimistic.)
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch
from _common import ModelSpec, global_batch, loss_fn, make_layers, make_optimizer
from torch import nn

from mpar.schedule import StageCosts, build_schedule, simulate

__all__ = ["bound", "measure"]


def _layer_samples(
    layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> list[tuple[float, float]]:
    """One forward and one backward time per layer, for one microbatch."""
    times = []
    activation: torch.Tensor = x
    for i, layer in enumerate(layers):
        inputs = activation.detach().requires_grad_(activation.is_floating_point())
        t0 = time.perf_counter()
        out = layer(inputs)
        loss = loss_fn(out, y) if i == len(layers) - 1 else None
        t1 = time.perf_counter()
        if loss is not None:
            loss.backward()
        else:
            out.backward(torch.ones_like(out))
        times.append((t1 - t0, time.perf_counter() - t1))
        activation = out.detach()
    return times


def measure(spec: ModelSpec, dp: int, rounds: int = 20) -> dict[str, Any]:
    """Median forward/backward seconds per layer and optimizer seconds per parameter.

    Rounds go over all layers in turn, so a burst of load elsewhere on the
    machine spreads over every layer instead of inflating one.
    """
    x, y = global_batch(spec)
    micro = spec.batch // (dp * spec.microbatches)
    layers = make_layers(spec)
    samples = [_layer_samples(layers, x[:micro], y[:micro]) for _ in range(rounds + 2)][2:]
    params = [p for layer in layers for p in layer.parameters()]
    opt = make_optimizer(params)
    opt_samples = []
    for i in range(rounds + 2):
        t = time.perf_counter()
        opt.step()
        if i >= 2:
            opt_samples.append(time.perf_counter() - t)
    return {
        "forward_s": [statistics.median(s[i][0] for s in samples) for i in range(len(layers))],
        "backward_s": [statistics.median(s[i][1] for s in samples) for i in range(len(layers))],
        "optimizer_s_per_param": statistics.median(opt_samples) / sum(p.numel() for p in params),
        "params": [sum(p.numel() for p in layer.parameters()) for layer in layers],
    }


def bound(
    costs: dict[str, Any], pipeline: str, pp: int, microbatches: int, stage_layers: list[int]
) -> dict[str, float]:
    """Simulated step time (seconds) of mpar's schedule with the measured layer costs.

    ``stage_layers`` is the number of layers in each stage (the split the run
    used); stage costs are sums over their layers, and the optimizer step of the
    rank with the most parameters is added after the schedule.
    """
    num_stages = len(stage_layers)
    bounds = [sum(stage_layers[:s]) for s in range(num_stages + 1)]
    slices = list(itertools.pairwise(bounds))
    forward = [sum(costs["forward_s"][a:b]) for a, b in slices]
    backward = [sum(costs["backward_s"][a:b]) for a, b in slices]
    per_rank = [0] * pp
    for s, (a, b) in enumerate(slices):
        per_rank[s % pp] += sum(costs["params"][a:b])
    optimizer = max(per_rank) * costs["optimizer_s_per_param"]
    schedule = build_schedule(pipeline, pp, microbatches, virtual_stages=num_stages // pp)
    result = simulate(schedule, StageCosts(forward, backward))
    return {
        "makespan_s": result.makespan,
        "optimizer_s": optimizer,
        "bound_s": result.makespan + optimizer,
        "bubble_fraction": result.bubble_fraction,
    }
