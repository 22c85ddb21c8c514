"""DeepSpeed: ``deepspeed.initialize`` with ``zero_optimization.stage`` 1-3 on the CPU
accelerator (``DS_ACCELERATOR=cpu``, gloo), torch's AdamW as the client optimizer.

Offload: ``offload_optimizer: {device: cpu}`` (+ ``offload_param`` at stage 3),
with ``zero_force_ds_cpu_optimizer: false`` so DeepSpeed keeps the same torch
AdamW as every other framework instead of demanding its compiled CPU Adam.

Model-state bytes: every distinct tensor storage reachable from the model's
parameters (``.data``, ``.grad``, ZeRO-3's ``ds_tensor`` partitions), from the
ZeRO optimizer object's attributes (flat parameter groups, fp32 master
partitions, gradient partitions and buffers) and from the inner optimizer's
state, classified by where it was found (see :func:`_groups`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from _common import set_threads, time_steps

from zero_peers.common import (
    ZeroCase,
    batch_slice,
    count_model_state,
    loss_fn,
    make_mlp,
    make_optimizer,
    report,
)


def _config(case: ZeroCase) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case.stage}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if case.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": case.model.batch,
        "train_micro_batch_size_per_gpu": case.model.batch // case.dp,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; nobody else clips
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)


def _category(name: str) -> str:
    lowered = name.lower()
    if "grad" in lowered or "ipg" in lowered:
        return "gradients"
    if "fp32" in lowered or "master" in lowered:
        return "optimizer"
    return "parameters"


def _groups(model: torch.nn.Module, zero_opt: Any) -> dict[str, list[torch.Tensor]]:
    groups: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "optimizer": []}
    for p in model.parameters():
        groups["parameters"].append(p.data)
        if getattr(p, "ds_tensor", None) is not None:
            groups["parameters"].append(p.ds_tensor)
        if p.grad is not None:
            groups["gradients"].append(p.grad)
    inner = getattr(zero_opt, "optimizer", None)
    if inner is not None:
        groups["optimizer"] += [
            v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)
        ]
    for name, value in vars(zero_opt).items():
        if name == "optimizer":
            continue
        groups[_category(name)] += list(_tensors(value))
    return groups


def run(case: ZeroCase) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    set_threads()
    net = make_mlp(case.model)
    engine, _, _, _ = deepspeed.initialize(
        model=net, optimizer=make_optimizer(net.parameters()), config=_config(case)
    )
    x, y = batch_slice(case.model, case.dp, dist.get_rank())

    def step() -> None:
        engine.backward(loss_fn(engine(x), y))
        engine.step()

    timing = time_steps(step, dist.barrier, case.warmup, case.steps)

    def full_params() -> list[torch.Tensor]:
        params = list(engine.module.parameters())
        if case.stage < 3:
            return [p.detach().clone() for p in params]
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]

    def measure_memory() -> dict[str, int]:
        engine.backward(loss_fn(engine(x), y))
        return count_model_state(_groups(engine.module, engine.optimizer))

    result = report(
        timing,
        full_params,
        measure_memory,
        case,
        dist.all_gather_object,
        dist.get_rank(),
        dist.get_world_size(),
    )
    result["zero_optimizer"] = type(engine.optimizer).__name__
    return result
