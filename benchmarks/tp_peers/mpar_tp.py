"""mpar: ``tensor_parallel_degree`` with ``GPT_TP_PLAN``, ``DistributedModel``,
``DistributedOptimizer`` and ``@mpar.step``."""

from __future__ import annotations

from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from tp_peers.common import TPCase, global_batch, local_bytes, loss_fn, make_model, make_optimizer
from tp_peers.common import result as make_result


def run(case: TPCase) -> dict[str, Any]:
    import torch.distributed as dist

    import mpar
    from mpar.testing.models import GPT_TP_PLAN

    mpar.init(
        {
            "tensor_parallel_degree": case.tp,
            "tp_plan": GPT_TP_PLAN,
            "pipeline_parallel_degree": 1,
            "microbatches": 1,
        }
    )
    threads = set_threads()
    model = mpar.DistributedModel(make_model(case.model))
    opt = mpar.DistributedOptimizer(make_optimizer(model.parameters()))

    @mpar.step
    def train_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    x, y = global_batch(case.model)

    def step() -> Any:
        out = train_step(model, x, y)
        opt.step()
        opt.zero_grad()
        return out

    losses = [float(step().reduce_mean()) for _ in range(case.warmup)]
    timing = measured_steps(step, mpar.barrier, 0, case.steps)
    params = list(model.local_parameters())
    memory = {"parameters": local_bytes(params)}
    memory["optimizer"] = sum(
        local_bytes(v for v in s.values() if torch.is_tensor(v)) for s in opt.state.values()
    )
    out = make_result(timing, losses, memory, dist.all_gather_object, mpar.size(), threads=threads)
    mpar.shutdown()
    return out
