"""What every framework in ``benchmarks/zero.py`` shares: model, data, optimizer, reporting.

The model is an MLP (``Linear`` + GELU layers, a few million fp32 parameters) that
every framework builds from the same seed and trains with the same AdamW on the
same fixed global batch; each data-parallel rank takes its contiguous slice of it
and the loss is the mean cross entropy over that slice (every framework averages
gradients over the replicas, so each step follows the whole-batch gradient).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _harness import JsonCase
from torch import nn

__all__ = [
    "MLPSpec",
    "ZeroCase",
    "batch_slice",
    "count_model_state",
    "global_batch",
    "loss_fn",
    "make_mlp",
    "make_optimizer",
    "report",
]


@dataclass(frozen=True)
class MLPSpec:
    """Sizes of the benchmark MLP and of one training step."""

    d_in: int = 256
    hidden: int = 1024
    layers: int = 4
    """Hidden-to-hidden ``Linear`` layers (plus the input and output layers)."""
    classes: int = 256
    batch: int = 64
    """Global batch (all data-parallel replicas together)."""

    def num_parameters(self) -> int:
        h = self.hidden
        return (self.d_in + 1) * h + self.layers * (h + 1) * h + (h + 1) * self.classes


@dataclass(frozen=True)
class ZeroCase(JsonCase):
    """One run: a framework at a ZeRO stage (or its equivalent) on ``dp`` ranks."""

    MODEL = MLPSpec

    framework: str
    """``mpar``, ``deepspeed``, ``fsdp2``, ``torch_zero`` (ZeroRedundancyOptimizer + DDP)
    or ``fairscale``."""
    stage: int
    offload: bool
    """mpar/DeepSpeed: optimizer offload to the CPU (+ parameters at stage 3);
    FSDP2: ``CPUOffloadPolicy``; fairscale FSDP: ``move_params_to_cpu``."""
    dp: int
    model: MLPSpec
    warmup: int = 3
    steps: int = 10
    gather: str = "unit"
    """mpar's ``zero.gather`` (``unit``, ``chunk`` or a number of units)."""
    params_out: str = ""
    """If set, rank 0 saves the trained parameters (full, module order) there."""

    def label(self) -> str:
        return f"{self.framework} z{self.stage}{' offload' if self.offload else ''} dp{self.dp}"


def make_mlp(spec: MLPSpec) -> nn.Sequential:
    """The model, identical (same seed) in every process and framework."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(spec.d_in, spec.hidden), nn.GELU()]
    for _ in range(spec.layers):
        layers += [nn.Linear(spec.hidden, spec.hidden), nn.GELU()]
    layers.append(nn.Linear(spec.hidden, spec.classes))
    return nn.Sequential(*layers)


def make_optimizer(params: Iterable[Any]) -> torch.optim.Optimizer:
    """torch's AdamW for every framework (DeepSpeed gets it as its client optimizer)."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets)


def global_batch(spec: MLPSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed global batch every step trains on."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.batch, spec.d_in, generator=g)
    y = torch.randint(0, spec.classes, (spec.batch,), generator=g)
    return x, y


def batch_slice(spec: MLPSpec, dp: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's contiguous share of the global batch."""
    if spec.batch % dp:
        raise ValueError(f"global batch {spec.batch} is not divisible by dp={dp}")
    x, y = global_batch(spec)
    n = spec.batch // dp
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def count_model_state(groups: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, int]:
    """Bytes of distinct storages per category, every device together (mpar's counting)."""
    from mpar.shard._byte_count import count_bytes

    total = {key: 0 for key in groups}
    for row in count_bytes(groups).values():
        for key, value in row.items():
            total[key] += value
    return total


def report(
    timing: dict[str, Any],
    full_params: Callable[[], list[torch.Tensor]],
    measure_memory: Callable[[], dict[str, int]],
    case: ZeroCase,
    all_gather_object: Callable[[list[Any], Any], None],
    rank: int,
    world: int,
    step_peaks: Callable[[], dict[str, int]] | None = None,
) -> dict[str, Any]:
    """Rank 0's result: timing, every rank's model-state bytes, and (optionally)
    the trained parameters saved to ``case.params_out``. Collective.

    ``full_params`` (a collective for sharded frameworks) runs right after the
    timed steps; ``measure_memory`` then runs one more forward and backward
    without an optimizer step and counts the model state, gradients included.
    """
    params = full_params()
    memories: list[Any] = [None] * world
    all_gather_object(memories, measure_memory())
    peaks: list[Any] = [None] * world
    if step_peaks is not None:  # the framework's own account of the last step's peaks
        all_gather_object(peaks, step_peaks())
    if rank == 0 and case.params_out:
        flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])
        torch.save(flat, case.params_out)
    return {
        **timing,
        "threads": torch.get_num_threads(),
        "memory_per_rank": memories,
        "reported_peaks_per_rank": peaks if step_peaks is not None else None,
        "world": world,
        "pid_env_rank": int(os.environ.get("RANK", "0")),
        "params_saved": bool(case.params_out) and Path(case.params_out).exists(),
    }
