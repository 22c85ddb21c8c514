"""DeepSpeed: ``PipelineModule(layers=..., partition_method="uniform")`` and
``engine.train_batch()``, on the CPU accelerator (``DS_ACCELERATOR=cpu``) with gloo.

The optimizer is the same torch SGD as everyone else's, handed to
``deepspeed.initialize`` (DeepSpeed's own fused/CPU Adam need compiled ops).
"""

from __future__ import annotations

import itertools
from typing import Any

from _common import (
    Case,
    global_batch,
    loss_fn,
    make_layers,
    make_optimizer,
    set_threads,
    time_steps,
)


def run(case: Case) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    threads = set_threads()
    m = case.model.microbatches
    micro = case.model.batch // (case.dp * m)
    net = PipelineModule(
        layers=make_layers(case.model),
        num_stages=case.pp,
        loss_fn=loss_fn,
        partition_method="uniform",
    )
    config = {
        "train_batch_size": case.model.batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=net, optimizer=make_optimizer(net.parameters()), config=config
    )
    x, y = global_batch(case.model)
    dp_rank = engine.grid.get_data_parallel_rank()
    start = dp_rank * micro * m
    pairs = [
        (
            x[start + i * micro : start + (i + 1) * micro],
            y[start + i * micro : start + (i + 1) * micro],
        )
        for i in range(m)
    ]
    data = itertools.cycle(pairs)

    def step() -> None:
        engine.train_batch(data)

    result = time_steps(step, dist.barrier, case.warmup, case.steps)
    result["threads"] = threads
    parts = [int(p) for p in net.parts]
    result["stage_layers"] = [b - a for a, b in itertools.pairwise(parts)]
    # gloo's threads must stop before the interpreter exits, or the process may abort
    # there ("terminate called without an active exception") after its work is done
    dist.barrier()
    dist.destroy_process_group()
    return result
