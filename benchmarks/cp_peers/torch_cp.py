"""torch's own context parallelism: ``torch.distributed.tensor.experimental.
context_parallel(mesh, buffers=[inputs, targets], buffer_seq_dims=[1, 1])`` around each
step of the plain model on a one-dimensional CPU mesh over every rank (gloo), the
gradients averaged over the ranks. Where it does not run, the job reports why (its
error's first line) instead of figures."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
from _common import set_threads
from _harness import measured_steps

from cp_peers.common import CPCase, fixed_batch, longest, loss_fn, make_model, make_optimizer


def run(case: CPCase) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    dist.init_process_group("gloo")
    threads = set_threads()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = make_model(case.model)
    opt = make_optimizer(model.parameters())

    def at(seq: int) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            x, y = fixed_batch(case.model, seq)
            with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
                loss = loss_fn(model(x), y)
                loss.backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            opt.zero_grad()
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            return whole / world

        return step

    def all_max(value: int) -> int:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    out: dict[str, Any] = {"threads": threads, "world": world}
    try:
        if case.lengths:
            out["longest"] = longest(case, at, dist.barrier, all_max)
        else:
            step = at(case.model.seq)
            out["warmup_losses"] = [float(step()) for _ in range(case.warmup)]
            out.update(measured_steps(step, dist.barrier, 0, case.steps))
    except Exception as exc:  # torch's CP on this machine: report why it does not run
        lines = [line for line in traceback.format_exception_only(exc) if line.strip()]
        out = {"unsupported": f"{type(exc).__name__}: {lines[-1].strip()[:400]}"}
    dist.destroy_process_group()
    return out
