"""DeepSpeed AutoTP for training: ``tensor_parallel.autotp_size`` with a
``partition_config`` naming the same layers as the other engines (q, k, v and
``mlp.0`` column-split, ``proj`` and ``mlp.2`` row-split), ZeRO off, torch's
AdamW as the client optimizer, the CPU accelerator and gloo."""

from __future__ import annotations

from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from tp_peers.common import (
    TPCase,
    global_batch,
    local_bytes,
    loss_fn,
    make_model,
    make_optimizer,
)
from tp_peers.common import result as make_result

LAYER_SPECS = [
    {"patterns": [r".*\.(q|k|v)\.weight$", r".*\.mlp\.0\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.proj\.weight$", r".*\.mlp\.2\.weight$"], "partition_type": "row"},
]


def unsupported() -> str | None:
    return None


def config(case: TPCase) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": case.model.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {
            "autotp_size": case.tp,
            "partition_config": {"use_default_specs": False, "layer_specs": LAYER_SPECS},
        },
    }


def run(case: TPCase) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    threads = set_threads()
    model = make_model(case.model)
    opt = make_optimizer(model.parameters())
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(case))
    x, y = global_batch(case.model)

    def step() -> torch.Tensor:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    losses = [float(step().detach()) for _ in range(case.warmup)]
    timing = measured_steps(step, dist.barrier, 0, case.steps)
    params = list(engine.module.parameters())
    memory = {"parameters": local_bytes(params)}
    memory["optimizer"] = sum(
        local_bytes(v for v in s.values() if torch.is_tensor(v)) for s in opt.state.values()
    )
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters() if "blocks.0." in n}
    out = make_result(
        timing,
        losses,
        memory,
        dist.all_gather_object,
        dist.get_world_size(),
        threads=threads,
        block0_shapes=shapes,
        dtypes=sorted({str(p.dtype) for p in params}),
    )
    dist.barrier()
    dist.destroy_process_group()
    return out
