"""DeepSpeed-MoE: ``deepspeed.moe.layer.MoE`` (dropless, ``ep_size`` = ep) in every block,
``deepspeed.initialize`` with the MoE parameter groups DeepSpeed asks for, torch's AdamW
as client optimizer, ``engine.backward`` / ``engine.step``; ``torchrun``,
``DS_ACCELERATOR=cpu``, gloo. Run it from an environment where ``deepspeed`` imports
(``--deepspeed-python``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from ep_peers.common import EPCase, EPSpec, ExpertMLP, MoEGPT, local_batch, loss_fn, result


def unsupported() -> str | None:
    """Why DeepSpeed-MoE cannot run in this environment, or None."""
    try:
        from deepspeed.moe.layer import MoE  # noqa: F401
    except Exception as exc:  # not installed, or its import fails on this machine
        return f"deepspeed.moe does not import here ({type(exc).__name__}: {exc})"
    return None


def _moe(ep: int) -> Any:
    from deepspeed.moe.layer import MoE

    def make(spec: EPSpec) -> Any:
        return MoE(
            hidden_size=spec.d_model,
            expert=ExpertMLP(spec),
            num_experts=spec.num_experts,
            ep_size=ep,
            k=spec.top_k,
            drop_tokens=False,
            use_rts=False,
        )

    return make


def run(case: EPCase) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import (
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    deepspeed.init_distributed(dist_backend="gloo")
    threads = set_threads()
    torch.manual_seed(0)
    net = MoEGPT(case.model, _moe(case.ep))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "all"}
    )
    opt = torch.optim.AdamW(groups, lr=1e-3, foreach=False)
    config = {
        "train_micro_batch_size_per_gpu": case.model.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": case.zero},
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    rank = dist.get_rank()
    x, y = local_batch(case.model, rank)
    sent = [0]
    real = dist.all_to_all_single

    signature = inspect.signature(real)

    def counted(*args: Any, **kw: Any) -> Any:
        given = signature.bind(*args, **kw).arguments
        inp, group = given["input"], given.get("group")
        size, me = dist.get_world_size(group), dist.get_rank(group)
        splits = given.get("input_split_sizes") or [inp.shape[0] // size] * size
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        sent[0] += (sum(splits) - splits[me]) * row
        return real(*args, **kw)

    def step() -> Any:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    losses = [float(step()) for _ in range(case.warmup)]
    dist.all_to_all_single = counted
    timing = measured_steps(step, dist.barrier, 0, case.steps)
    dist.all_to_all_single = real
    experts = [p for p in net.parameters() if is_moe_param(p)]
    mine = {
        "a2a_bytes_per_step": sent[0] / case.steps,
        "expert_bytes": sum(p.numel() * p.element_size() for p in experts),
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = result(timing, losses, {"per_rank": every, "threads": threads})
    dist.destroy_process_group()
    return out
