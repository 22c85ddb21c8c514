"""Gradient reduction after the pipeline's backward passes.

Data parallelism: when a stage's last backward of the step is done, its
gradients are flattened into one buffer (plus one presence flag per
parameter, so a parameter no replica used keeps ``grad = None``) and an
asynchronous sum all-reduce over the stage's data-parallel group starts; the
remaining schedule runs meanwhile. Losses were already scaled by
``1 / dp_size``, so the sum is the whole-batch gradient.

Tied parameters (one original parameter on stages held by different ranks, e.g.
an embedding and the LM head) have their gradients summed over the ranks that
hold them, so every copy takes the same optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpar.comm import State
from mpar.comm._collectives import all_reduce_dp_async, all_reduce_group

if TYPE_CHECKING:
    from mpar.runtime._stages import LocalStages

__all__ = ["GradReducer"]


def stage_parameters(stages: LocalStages) -> dict[int, list[nn.Parameter]]:
    """Trainable parameters per local stage, each parameter under its lowest stage."""
    seen: set[int] = set()
    owned: dict[int, list[nn.Parameter]] = {}
    for s in sorted(stages.modules):
        params = []
        for p in stages.modules[s].parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        owned[s] = params
    return owned


class GradReducer:
    """Starts each stage's data-parallel all-reduce and finishes them all."""

    def __init__(self, stages: LocalStages, st: State) -> None:
        self.st = st
        self.stages = stages
        self.params = stage_parameters(stages)
        self.in_flight: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []

    def start(self, stage: int) -> None:
        params = self.params.get(stage, [])
        if not params or self.st.grid.dp_size == 1:
            return
        parts = []
        for p in params:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(grad.reshape(-1))
        flags = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype)
        flat = torch.cat(parts + [flags.to(parts[0].device)])
        self.in_flight.append((params, flat, all_reduce_dp_async(flat)))

    def finish(self) -> None:
        for params, flat, work in self.in_flight:
            if work is not None:
                work.wait()
            flags = flat[-len(params) :]
            offset = 0
            for p, used in zip(params, flags.tolist()):
                n = p.numel()
                if used:
                    p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        self.in_flight.clear()
        self._reduce_tied()

    def _reduce_tied(self) -> None:
        for group, param in self.stages.tied_groups:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grad = all_reduce_group(grad.clone(), group)
            param.grad = grad
