"""torch's own tensor parallelism, applied by hand as torchtitan does: a 1-D CPU
``DeviceMesh`` and ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` per Linear of every block, a plain AdamW and ``loss.backward()``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import set_threads
from _harness import measured_steps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from tp_peers.common import (
    SPLIT,
    TPCase,
    global_batch,
    local_bytes,
    loss_fn,
    make_model,
    make_optimizer,
)
from tp_peers.common import result as make_result


def plan(num_layers: int) -> dict[str, ParallelStyle]:
    """``{"blocks.N.q": ColwiseParallel(), ..., "blocks.N.mlp.2": RowwiseParallel()}``."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {
        f"blocks.{n}.{name}": styles[style]()
        for n in range(num_layers)
        for name, style in SPLIT.items()
    }


def run(case: TPCase) -> dict[str, Any]:
    dist.init_process_group("gloo")
    threads = set_threads()
    mesh = init_device_mesh("cpu", (case.tp,))
    model = make_model(case.model)
    parallelize_module(model, mesh, plan(case.model.num_layers))
    opt = make_optimizer(model.parameters())
    x, y = global_batch(case.model)

    def step() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = [float(step().detach()) for _ in range(case.warmup)]
    timing = measured_steps(step, dist.barrier, 0, case.steps)
    memory = {"parameters": local_bytes(model.parameters())}
    memory["optimizer"] = sum(
        local_bytes(v for v in s.values() if torch.is_tensor(v)) for s in opt.state.values()
    )
    out = make_result(
        timing, losses, memory, dist.all_gather_object, dist.get_world_size(), threads=threads
    )
    dist.barrier()
    dist.destroy_process_group()
    return out
