"""mpar: ``expert_parallel_degree`` (the MoE layers found by structure), ZeRO over dp,
``DistributedModel``, ``DistributedOptimizer`` and ``@mpar.step``."""

from __future__ import annotations

from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from ep_peers.common import EPCase, MoEGPT, local_batch, loss_fn, make_optimizer, result


def _expert_bytes(model: Any, experts: frozenset[int]) -> int:
    """Bytes of expert parameters this rank keeps between steps, counted from its
    tensors: its experts whole, or at ZeRO-3 the part of them in its bucket shards."""
    if model.sharded is None or model.config.zero.stage < 3:
        held = (p for p in model.local_parameters() if id(p) in experts)
        return sum(p.numel() * p.element_size() for p in held)
    total = 0
    for bucket in model.sharded.buckets:
        size = bucket.shard.element_size()
        for slot, p in zip(bucket.spec.slots, bucket.params):
            if id(p) in experts:
                lo, hi = max(slot.offset, bucket.lo), min(slot.offset + slot.numel, bucket.hi)
                total += max(0, hi - lo) * size
    return total


def _experts_of(model: Any) -> frozenset[int]:
    """ids of the expert parameters (also at ep = 1, where none is split)."""
    from mpar.expert_parallel import find_experts

    names = find_experts(model.module, None)
    return frozenset(id(p) for n in names for p in model.module.get_submodule(n).parameters())


def run(case: EPCase) -> dict[str, Any]:
    import torch.distributed as dist

    import mpar
    from mpar.comm._ep_ops import TRAFFIC

    mpar.init({"expert_parallel_degree": case.ep, "zero": {"stage": case.zero}})
    threads = set_threads()
    torch.manual_seed(0)
    model = mpar.DistributedModel(MoEGPT(case.model))
    opt = mpar.DistributedOptimizer(make_optimizer(model.parameters()))
    experts = _experts_of(model)

    @mpar.step
    def train_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    x, y = local_batch(case.model, mpar.dp_rank())

    def step() -> Any:
        out = train_step(model, x, y)
        opt.step()
        opt.zero_grad()
        return out

    losses = [float(step().reduce_mean()) for _ in range(case.warmup)]
    TRAFFIC.reset()
    timing = measured_steps(step, mpar.barrier, 0, case.steps)
    traffic = {
        "a2a_bytes_per_step": TRAFFIC.bytes_sent / case.steps,
        "count_bytes_per_step": TRAFFIC.count_bytes / case.steps,
        "pairs_routed": TRAFFIC.pairs_routed,
        "pairs_received": TRAFFIC.pairs_received,
        "expert_bytes": _expert_bytes(model, experts),
    }
    every: list[Any] = [None] * mpar.size()
    dist.all_gather_object(every, traffic)
    out = result(timing, losses, {"per_rank": every, "threads": threads})
    mpar.shutdown()
    return out
