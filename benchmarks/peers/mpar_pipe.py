"""mpar: ``DistributedModel`` over an ``nn.Sequential`` of the benchmark layers."""

from __future__ import annotations

from typing import Any

import torch
from _common import (
    BACKEND,
    MEASURED,
    Case,
    global_batch,
    loss_fn,
    make_layers,
    make_optimizer,
    set_threads,
    stage_slices,
    time_steps,
)
from torch import nn


def _sequential(case: Case) -> nn.Sequential:
    """The layers as one ``nn.Sequential``, placed with ``mpar.partition`` for a uniform split."""
    import mpar

    layers = make_layers(case.model)
    net = nn.Sequential()
    if case.split == "auto":
        for i, layer in enumerate(layers):
            net.add_module(str(i), layer)
        return net
    for stage, (start, stop) in enumerate(stage_slices(len(layers), case.num_stages)):
        with mpar.partition(stage):
            for i in range(start, stop):
                net.add_module(str(i), layers[i])
    return net


def _schedule_keys(case: Case) -> dict[str, Any]:
    if case.schedule.endswith(BACKEND):
        return {"pipeline": case.schedule.removesuffix(BACKEND), "shared_memory": False}
    if case.schedule != MEASURED:
        return {"pipeline": case.schedule}
    from mpar.schedule import zero_bubble_peak

    m, p, v = case.model.microbatches, case.pp, case.virtual_stages
    return {"pipeline": "zero_bubble", "active_microbatches": min(m, zero_bubble_peak(p, m, v) + 1)}


def run(case: Case) -> dict[str, Any]:
    import mpar

    mpar.init(
        {
            "pipeline_parallel_degree": case.pp,
            "microbatches": case.model.microbatches,
            "virtual_stages": case.virtual_stages,
            "ddp": case.dp > 1,
            "auto_partition": case.split == "auto",
            **_schedule_keys(case),
        }
    )
    threads = set_threads()
    model = mpar.DistributedModel(_sequential(case))
    opt = mpar.DistributedOptimizer(make_optimizer(model.parameters()))

    @mpar.step
    def train_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    x, y = global_batch(case.model)
    per_replica = case.model.batch // case.dp
    shard = slice(mpar.dp_rank() * per_replica, (mpar.dp_rank() + 1) * per_replica)
    xs, ys = x[shard], y[shard]

    def step() -> None:
        train_step(model, xs, ys)
        opt.step()
        opt.zero_grad()

    result = time_steps(step, mpar.barrier, case.warmup, case.steps)
    result["threads"] = threads
    assert model.stages is not None
    result["stage_layers"] = [len(names) for names in model.stages.unit_names]
    result["stage_units"] = model.stages.unit_names
    mpar.shutdown()
    return result
