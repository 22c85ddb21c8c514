"""fairscale: ``OSS`` + ``ShardedDataParallel`` (ZeRO-2) and ``FullyShardedDataParallel``
(ZeRO-3), on CPU tensors over gloo.

Stage 2: ``ShardedDataParallel`` reduces every gradient to the rank whose ``OSS``
shard owns its parameter (the others drop theirs) and ``OSS`` wraps torch's
AdamW over that rank's parameters (whole parameters, greedy by size), then
broadcasts the updated ones. fairscale has no optimizer offload there.

Stage 3 (CUDA only, see :func:`unsupported`): ``FullyShardedDataParallel`` on every ``Linear`` and on the root,
``compute_device=cpu``, ``flatten_parameters=True``, ``mixed_precision=False``
(fp32, like every other framework); ``offload`` sets ``move_params_to_cpu``
(its fp32 shards and gradients on the CPU; on a CPU "device" that adds a
compute copy of the shard instead of moving bytes).

Model-state bytes: the parameters' storages (full at stage 2; the flat local
shards and, with ``move_params_to_cpu``, the compute-side shard copies at
stage 3), the gradients (``p.grad`` plus ``ShardedDataParallel``'s reduce
buckets) and the inner AdamW's state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import set_threads, time_steps
from torch import nn

from zero_peers.common import (
    ZeroCase,
    batch_slice,
    count_model_state,
    loss_fn,
    make_mlp,
    report,
)

STAGES = (2, 3)
"""The stages fairscale covers here (``OSS`` alone with DDP would be ZeRO-1)."""


def unsupported(stage: int) -> str | None:
    """Why fairscale cannot run ``stage`` on this machine, or None."""
    if stage == 3 and not torch.cuda.is_available():
        return (
            "fairscale 0.4.13's FullyShardedDataParallel needs CUDA: its forward enters "
            "torch.cuda.stream(self._streams['all_gather']) and _streams is filled only when "
            "torch.cuda.is_available() (KeyError: 'all_gather' on a CPU-only torch, whatever "
            "compute_device, flatten_parameters or mixed_precision)"
        )
    return None


def _adamw_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _sharded_ddp(case: ZeroCase) -> dict[str, Any]:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    net = make_mlp(case.model)
    opt = OSS(net.parameters(), optim=torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    model = ShardedDataParallel(net, opt)
    x, y = batch_slice(case.model, case.dp, dist.get_rank())

    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        # ShardedDataParallel's own zero_grad: it clears its reduce buckets too.
        # OSS.zero_grad() left stale bucket contents in the next step's gradients
        # (trained parameters off by 2e-3 after 2 steps, dp = 2).
        model.zero_grad()

    timing = time_steps(step, dist.barrier, case.warmup, case.steps)

    def measure_memory() -> dict[str, int]:
        loss_fn(model(x), y).backward()
        buckets = [  # {device: {destination rank: GradBucket}}
            bucket.buffer
            for per_device in model._buckets.values()
            for bucket in per_device.values()
            if bucket.buffer is not None
        ]
        return count_model_state(
            {
                "parameters": [p.data for p in net.parameters()],
                "gradients": [p.grad for p in net.parameters() if p.grad is not None] + buckets,
                "optimizer": _adamw_state(opt.optim),
            }
        )

    return report(
        timing,
        lambda: list(net.parameters()),
        measure_memory,
        case,
        dist.all_gather_object,
        dist.get_rank(),
        dist.get_world_size(),
    )


def _fsdp(case: ZeroCase) -> dict[str, Any]:
    from fairscale.nn import FullyShardedDataParallel

    cpu = torch.device("cpu")
    kwargs: dict[str, Any] = {
        "compute_device": cpu,
        "flatten_parameters": True,
        "mixed_precision": False,
        "move_params_to_cpu": case.offload,
    }
    net = make_mlp(case.model)
    for i, layer in enumerate(net):
        if isinstance(layer, nn.Linear):
            net[i] = FullyShardedDataParallel(layer, **kwargs)
    model = FullyShardedDataParallel(net, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = batch_slice(case.model, case.dp, dist.get_rank())

    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    timing = time_steps(step, dist.barrier, case.warmup, case.steps)

    def full_params() -> list[torch.Tensor]:
        return [t.clone() for t in model.state_dict().values()]  # full, module order

    def measure_memory() -> dict[str, int]:
        loss_fn(model(x), y).backward()
        params: list[torch.Tensor] = []
        for p in model.parameters():
            params.append(p.data)
            for name in ("_fp32_shard", "_fp16_shard", "_full_param_padded"):
                t = getattr(p, name, None)
                if torch.is_tensor(t) and t.untyped_storage().nbytes():
                    params.append(t)
        return count_model_state(
            {
                "parameters": params,
                "gradients": [p.grad for p in model.parameters() if p.grad is not None],
                "optimizer": _adamw_state(opt),
            }
        )

    return report(
        timing,
        full_params,
        measure_memory,
        case,
        dist.all_gather_object,
        dist.get_rank(),
        dist.get_world_size(),
    )


def run(case: ZeroCase) -> dict[str, Any]:
    if case.stage not in STAGES:
        raise ValueError(f"fairscale runs zero stage 2 or 3 here, not {case.stage}")
    if case.stage == 2 and case.offload:
        raise ValueError("fairscale's OSS + ShardedDataParallel has no optimizer offload")
    reason = unsupported(case.stage)
    if reason is not None:
        raise RuntimeError(reason)
    dist.init_process_group("gloo")
    set_threads()
    result = _sharded_ddp(case) if case.stage == 2 else _fsdp(case)
    dist.barrier()
    dist.destroy_process_group()
    return result
