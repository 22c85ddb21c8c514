"""torch.distributed.pipelining: ``PipelineStage``s built by hand from the uniform split.

Ranks are laid out as mpar's default ``cluster`` placement (rank = dp_rank * pp
+ pp_rank); with data parallelism the stage gradients are summed over the
data-parallel group after the schedule's step (one flat all-reduce per rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import (
    Case,
    global_batch,
    loss_fn,
    make_layers,
    make_optimizer,
    set_threads,
    stage_slices,
    time_steps,
)
from torch import nn


def _groups(pp: int, dp: int, rank: int) -> tuple[Any, Any]:
    """This rank's pipeline group and data-parallel group (every rank creates all)."""
    pp_group = dp_group = None
    for d in range(dp):
        group = dist.new_group([d * pp + p for p in range(pp)])
        if rank // pp == d:
            pp_group = group
    for p in range(pp):
        group = dist.new_group([d * pp + p for d in range(dp)])
        if rank % pp == p:
            dp_group = group
    return pp_group, dp_group


def _schedule(case: Case, stages: list[Any]) -> Any:
    from torch.distributed import pipelining as pipe

    m = case.model.microbatches
    multi = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
    if case.schedule in multi:
        return getattr(pipe, case.schedule)(stages, m, loss_fn=loss_fn)
    cls = {"ScheduleGPipe": pipe.ScheduleGPipe, "Schedule1F1B": pipe.Schedule1F1B}[case.schedule]
    return cls(stages[0], m, loss_fn=loss_fn)


def _all_reduce_grads(params: list[nn.Parameter], group: Any, dp: int) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def run(case: Case) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    dist.init_process_group("gloo")
    threads = set_threads()
    rank = dist.get_rank()
    pp_rank, dp_rank = rank % case.pp, rank // case.pp
    pp_group, dp_group = _groups(case.pp, case.dp, rank)
    layers = make_layers(case.model)
    slices = stage_slices(len(layers), case.num_stages)
    mine = [pp_rank + k * case.pp for k in range(case.virtual_stages)]
    if case.schedule == "ScheduleZBVZeroBubble":  # V placement: r and 2p-1-r
        mine = [pp_rank, 2 * case.pp - 1 - pp_rank]
    modules = {s: nn.Sequential(*layers[slices[s][0] : slices[s][1]]) for s in mine}
    del layers
    device = torch.device("cpu")
    stages = [PipelineStage(modules[s], s, case.num_stages, device, group=pp_group) for s in mine]
    schedule = _schedule(case, stages)
    params = [p for s in mine for p in modules[s].parameters()]
    opt = make_optimizer(params)

    x, y = global_batch(case.model)
    per_replica = case.model.batch // case.dp
    shard = slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
    xs, ys = x[shard], y[shard]
    first, last = 0 in mine, case.num_stages - 1 in mine

    def step() -> None:
        args = (xs,) if first else ()
        target = ys if last else None
        losses: list[torch.Tensor] | None = [] if last else None
        schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if case.dp > 1:
            _all_reduce_grads(params, dp_group, case.dp)
        opt.step()
        opt.zero_grad()

    result = time_steps(step, dist.barrier, case.warmup, case.steps)
    result["threads"] = threads
    result["stage_layers"] = [stop - start for start, stop in slices]
    dist.destroy_process_group()
    return result
