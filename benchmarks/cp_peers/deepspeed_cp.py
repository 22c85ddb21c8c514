"""DeepSpeed Ulysses: every attention call wrapped in ``deepspeed.sequence.layer.
DistributedAttention`` over the sequence-parallel group (here every rank: dp 1), each rank
feeding its contiguous ``1/cp`` of every sequence with global positions; the DeepSpeed
engine (ZeRO off, torch's SGD as the client optimizer) averages the gradients over the
ranks, whose losses are token means over equal shares. CPU accelerator, gloo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from cp_peers.common import (
    CPCase,
    causal_sdpa,
    fixed_batch,
    longest,
    loss_fn,
    make_model,
    make_optimizer,
)


def unsupported() -> str | None:
    return None


def _attention(group: Any) -> Callable[..., torch.Tensor]:
    from deepspeed.sequence.layer import DistributedAttention

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> torch.Tensor:
        # [batch, seq, heads / cp, dim] for the whole sequence -> the unchanged attention
        out = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    ulysses = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # the model's [batch, heads, seq / cp, dim] <-> Ulysses' batch-first [b, s, h, d]
        out = ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
        return out.transpose(1, 2)

    return attention


def run(case: CPCase) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    threads = set_threads()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))

    def positions(ids: torch.Tensor) -> torch.Tensor:
        local = ids.shape[1]
        return (torch.arange(local) + rank * local).expand(ids.shape[0], -1)

    model = make_model(case.model, attention=_attention(group), positions=positions)
    config = {
        "train_micro_batch_size_per_gpu": case.model.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=make_optimizer(model.parameters()), config=config
    )

    def at(seq: int) -> Callable[[], torch.Tensor]:
        x, y = fixed_batch(case.model, seq)
        piece = slice(rank * seq // world, (rank + 1) * seq // world)
        x, y = x[:, piece].contiguous(), y[:, piece].contiguous()

        def step() -> torch.Tensor:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            return whole / world

        return step

    def all_max(value: int) -> int:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    out: dict[str, Any] = {"threads": threads, "world": world}
    if case.lengths:
        out["longest"] = longest(case, at, dist.barrier, all_max)
    else:
        step = at(case.model.seq)
        out["warmup_losses"] = [float(step()) for _ in range(case.warmup)]
        out.update(measured_steps(step, dist.barrier, 0, case.steps))
    dist.destroy_process_group()  # DeepSpeed's peer aborted at exit without it (pipeline.py)
    return out
