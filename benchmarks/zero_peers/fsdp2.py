"""FSDP2: ``fully_shard`` on every ``Linear`` and on the root (ZeRO-3 equivalent).

Parameters, gradients and AdamW state are DTensors sharded on dim 0 over a
1-D CPU device mesh (gloo); ``offload`` adds ``CPUOffloadPolicy()`` (on a CPU
mesh the "device" is the CPU as well, so this measures its extra copies and
bookkeeping). Model-state bytes count the local shards (``to_local()``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import set_threads, time_steps
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from zero_peers.common import (
    ZeroCase,
    batch_slice,
    count_model_state,
    loss_fn,
    make_mlp,
    make_optimizer,
    report,
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run(case: ZeroCase) -> dict[str, Any]:
    dist.init_process_group("gloo")
    set_threads()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = make_mlp(case.model)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if case.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    opt = make_optimizer(net.parameters())
    x, y = batch_slice(case.model, case.dp, dist.get_rank())

    def step() -> None:
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    timing = time_steps(step, dist.barrier, case.warmup, case.steps)

    def full_params() -> list[torch.Tensor]:
        return [p.full_tensor() if isinstance(p, DTensor) else p for p in net.parameters()]

    def measure_memory() -> dict[str, int]:
        loss_fn(net(x), y).backward()
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return count_model_state(
            {
                "parameters": [_local(p.data) for p in net.parameters()],
                "gradients": [_local(p.grad) for p in net.parameters() if p.grad is not None],
                "optimizer": [_local(v) for v in state],
            }
        )

    result = report(
        timing,
        full_params,
        measure_memory,
        case,
        dist.all_gather_object,
        dist.get_rank(),
        dist.get_world_size(),
    )
    # Every rank leaves FSDP's collectives before the group goes away: tearing it
    # down while a peer still runs one aborted a rank now and then (C++
    # "terminate called without an active exception", dp = 4).
    dist.barrier()
    dist.destroy_process_group()
    return result
