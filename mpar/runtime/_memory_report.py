"""``mpar.memory_report()``: the bytes this rank holds, by device and category."""

from __future__ import annotations

import torch

from mpar import _device
from mpar.comm._lifecycle import Session, session
from mpar.runtime._distributed_optimizer import DistributedOptimizer
from mpar.runtime._model import DistributedModel
from mpar.shard._byte_count import count_bytes

__all__ = ["memory_report"]

_CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "gathered_peak",
    "gradients_peak",
)


def _plain_groups(
    local: list[torch.nn.Parameter], process: Session
) -> dict[str, list[torch.Tensor]]:
    ids = {id(p) for p in local}
    optimizer: list[torch.Tensor] = []
    for opt in [o for o in list(process.optimizers) if isinstance(o, DistributedOptimizer)]:
        if opt.sharded_optimizer() is None:
            for param, values in opt.optimizer.state.items():
                if id(param) in ids:
                    optimizer += [v for v in values.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": [p.data for p in local],
        "gradients": [p.grad for p in local if p.grad is not None],
        "optimizer": optimizer,
    }


def memory_report() -> dict[str, dict[str, int]]:
    """This rank's bytes of parameters, gradients, optimizer state and activations.

    Returns ``{device: {"parameters", "gradients", "optimizer", "activations": bytes}}``.
    Each storage is counted once (a parameter that is a view of a flat ZeRO
    buffer counts with that buffer). Parameters of stages held by other
    ranks are not counted (their storage was released). The last step's
    peaks (0 before the first step): ``activations``, the most bytes kept for
    backward at once: stage inputs and outputs, and every tensor autograd
    saved inside the stages (parameters excepted; with activation
    checkpointing only what the checkpoints keep); ``gathered_peak`` (ZeRO-3),
    the most bytes of gathered full parameters held at once, on top of the
    shards counted under ``parameters``; ``gradients_peak``, the most bytes of
    gradient buffers (flat buffers accumulated into or in reduction, reduced
    shards) held at once — with unit-granular ZeRO 2/3 about one unit's
    gradients, else the stage's. On devices
    whose allocator keeps statistics (CUDA; XLA on TPU/GPU) the device's row
    also has ``device_allocated`` and ``device_peak``: the allocator's current
    bytes, and its peak since the last step began (CUDA: reset as each
    ``@mpar.step`` call starts, so the peak covers that step, and the optimizer
    step and anything else run after it; XLA: since the process started),
    everything included; on CUDA also ``device_reserved``, what the caching
    allocator holds.
    """
    process = session()
    st = process.state
    report: dict[str, dict[str, int]] = {}
    for model in [m for m in list(process.models) if isinstance(m, DistributedModel)]:
        if model.sharded is not None:
            part = model.sharded.memory_report()
        else:
            part = count_bytes(_plain_groups(model.local_parameters(), process))
        for device, row in part.items():
            mine = report.setdefault(device, dict.fromkeys(_CATEGORIES, 0))
            for key, value in row.items():
                mine[key] = mine.get(key, 0) + value
        device = str(st.device)
        report.setdefault(device, dict.fromkeys(_CATEGORIES, 0))
        report[device]["activations"] += model.activation_peak_bytes
        if model.sharded is not None:
            report[device]["gathered_peak"] += model.sharded.peak_gathered_bytes
            report[device]["gradients_peak"] += model.sharded.peak_grad_bytes
    _add_allocator_stats(report, st.device)
    return report


def _add_allocator_stats(report: dict[str, dict[str, int]], device: torch.device) -> None:
    """The device allocator's own counts, where it keeps them (CUDA; XLA on TPU/GPU)."""
    stats = _device.memory_stats(device)
    if stats:
        row = report.setdefault(str(device), dict.fromkeys(_CATEGORIES, 0))
        row["device_allocated"] = stats["allocated"]
        row["device_peak"] = stats["peak"]
        if "reserved" in stats:
            row["device_reserved"] = stats["reserved"]
