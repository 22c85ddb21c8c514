"""Batch-norm running statistics, kept equal across data-parallel replicas.

A batch-norm layer in training mode updates its running mean and variance in its
forward pass. Each data-parallel replica sees only its share of the batch, so each
would drift to its own statistics, and the replicas' models (and ``state_dict()``,
which every rank gathers from its own replica) would differ. After every step in
which such a layer is in training mode, its running statistics are averaged over
the stage's data-parallel group: one all-reduce per dtype (and device).
``num_batches_tracked`` advances alike on every replica and is left alone.

Which layers: every ``torch.nn.modules.batchnorm._NormBase`` that tracks running
statistics (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``InstanceNorm`` with
``track_running_stats=True``). Other buffers that a model updates in place in its
forward are not averaged (their kernels need not say so: batch norm's own does not
bump the tensors' version counters).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from mpar.comm import ProcessGrid
from mpar.comm._collectives import all_reduce_dp

__all__ = ["ReplicaBuffers"]

_STATISTICS = ("running_mean", "running_var")


class ReplicaBuffers:
    """The running statistics of the batch-norm layers on this rank's stages.

    ``module``: the original model; ``stages``: this rank's stage modules, with
    ``qualnames`` mapping each stage's local names to the original ones.
    """

    def __init__(
        self,
        module: nn.Module,
        stages: Mapping[int, nn.Module],
        qualnames: Mapping[int, Mapping[str, str]],
    ) -> None:
        norms = {
            f"{name}.{stat}" if name else stat: norm
            for name, norm in module.named_modules()
            if isinstance(norm, _NormBase) and norm.track_running_stats
            for stat in _STATISTICS
        }
        self.entries: list[tuple[nn.Module, str, nn.Module]] = []
        """(stage, its local buffer name, the original norm layer) for each statistic."""
        for k, stage in stages.items():
            for local, _ in stage.named_buffers():
                original = qualnames.get(k, {}).get(local, local)
                if original in norms:
                    self.entries.append((stage, local, norms[original]))

    def average(self, grid: ProcessGrid) -> None:
        """Average, over the data-parallel group, the statistics of the layers in training
        mode (called after every step; the replicas agree on the mode)."""
        if grid.dp_size == 1:
            return
        kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for stage, local, norm in self.entries:
            if norm.training:
                buffer = stage.get_buffer(local)
                kinds.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        with torch.no_grad():
            for buffers in kinds.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                all_reduce_dp(flat, grid).div_(grid.dp_size)
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
