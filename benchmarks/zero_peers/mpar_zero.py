"""mpar: ``DistributedModel`` + ``DistributedOptimizer`` with ``zero.stage`` 1-3, pp = 1."""

from __future__ import annotations

from typing import Any

import torch
from _common import set_threads, time_steps

from zero_peers.common import ZeroCase, batch_slice, loss_fn, make_mlp, make_optimizer, report


def run(case: ZeroCase) -> dict[str, Any]:
    import mpar

    gather = int(case.gather) if case.gather.isdigit() else case.gather
    zero: dict[str, Any] = {"stage": case.stage, "gather": gather}
    if case.offload:
        zero["offload_optimizer"] = "cpu"
        if case.stage == 3:
            zero["offload_params"] = "cpu"
    mpar.init({"pipeline_parallel_degree": 1, "microbatches": 1, "ddp": True, "zero": zero})
    set_threads()
    model = mpar.DistributedModel(make_mlp(case.model))
    opt = mpar.DistributedOptimizer(make_optimizer(model.parameters()))

    @mpar.step
    def train_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    x, y = batch_slice(case.model, case.dp, mpar.dp_rank())

    def step() -> None:
        train_step(model, x, y)
        opt.step()
        opt.zero_grad()

    timing = time_steps(step, mpar.barrier, case.warmup, case.steps)

    def full_params() -> list[torch.Tensor]:
        return list(model.state_dict().values())  # gathered, module order

    def measure_memory() -> dict[str, int]:
        train_step(model, x, y)
        cats = ("parameters", "gradients", "optimizer")
        return {k: sum(row[k] for row in mpar.memory_report().values()) for k in cats}

    def step_peaks() -> dict[str, int]:
        """The last step's peaks as mpar.memory_report() counts them."""
        cats = ("gathered_peak", "gradients_peak", "activations")
        return {k: sum(row[k] for row in mpar.memory_report().values()) for k in cats}

    import torch.distributed as dist

    result = report(
        timing,
        full_params,
        measure_memory,
        case,
        dist.all_gather_object,
        mpar.rank(),
        mpar.size(),
        step_peaks,
    )
    mpar.shutdown()
    return result
