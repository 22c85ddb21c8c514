"""mpar: ``context_parallel_degree`` cp with the ring or the all-to-all, ``DistributedModel``,
``DistributedOptimizer`` and ``@mpar.step``; the model's positions from
``mpar.context_parallel.position_ids``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from cp_peers.common import CPCase, fixed_batch, longest, loss_fn, make_model, make_optimizer


def run(case: CPCase) -> dict[str, Any]:
    import mpar
    import mpar.context_parallel
    from mpar.comm._collectives import all_gather_object_world, world_all_reduce

    mpar.init({"context_parallel_degree": case.cp, "context_parallel_method": case.method})
    threads = set_threads()
    net = make_model(case.model, positions=mpar.context_parallel.position_ids)
    model = mpar.DistributedModel(net, dynamic_axes=(0, 1))  # lengths change: longest search
    opt = mpar.DistributedOptimizer(make_optimizer(model.parameters()))

    @mpar.step
    def train_step(m: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(input_ids), labels)
        m.backward(loss)
        return loss

    def at(seq: int) -> Callable[[], Any]:
        x, y = fixed_batch(case.model, seq)

        def step() -> Any:
            out = train_step(model, x, y)
            opt.step()
            opt.zero_grad()
            return out

        return step

    def all_max(value: int) -> int:
        t = torch.tensor([value])
        world_all_reduce(t, mpar.comm.state().grid, "max")
        return int(t)

    out: dict[str, Any] = {"threads": threads, "world": mpar.size()}
    if case.lengths:
        out["longest"] = longest(case, at, mpar.barrier, all_max)
    else:
        step = at(case.model.seq)
        out["warmup_losses"] = [float(step().reduce_mean()) for _ in range(case.warmup)]
        out.update(measured_steps(step, mpar.barrier, 0, case.steps))
        held = mpar.memory_report()[str(mpar.comm.state().device)]["activations"]
        out["activations_per_rank"] = all_gather_object_world(held, mpar.comm.state().grid)
    mpar.shutdown()
    return out
