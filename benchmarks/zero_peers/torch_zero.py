"""torch: ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` (ZeRO-1 equivalent).

``ZeroRedundancyOptimizer`` assigns whole parameters to ranks (greedy by size),
each rank keeping the AdamW state of its own; after ``step()`` every rank
broadcasts the parameters it updated. DDP's gradients are views of its
all-reduce buckets (``gradient_as_bucket_view=True``), so counting ``p.grad``
storages counts the buckets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import set_threads, time_steps
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from zero_peers.common import (
    ZeroCase,
    batch_slice,
    count_model_state,
    loss_fn,
    make_mlp,
    report,
)


def run(case: ZeroCase) -> dict[str, Any]:
    dist.init_process_group("gloo")
    set_threads()
    net = make_mlp(case.model)
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01
    )
    x, y = batch_slice(case.model, case.dp, dist.get_rank())

    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    timing = time_steps(step, dist.barrier, case.warmup, case.steps)

    def measure_memory() -> dict[str, int]:
        loss_fn(model(x), y).backward()
        state = [v for s in opt.optim.state.values() for v in s.values() if torch.is_tensor(v)]
        return count_model_state(
            {
                "parameters": [p.data for p in net.parameters()],
                "gradients": [p.grad for p in net.parameters() if p.grad is not None],
                "optimizer": state,
            }
        )

    result = report(
        timing,
        lambda: list(net.parameters()),
        measure_memory,
        case,
        dist.all_gather_object,
        dist.get_rank(),
        dist.get_world_size(),
    )
    dist.destroy_process_group()
    return result
