"""Running a stage's forward, optionally with activation checkpointing.

With ``activation_checkpointing`` on, a stage keeps only its inputs during the
forward pass and recomputes the forward inside its backward
(``torch.utils.checkpoint``, non-reentrant, RNG state restored so dropout
draws the same mask). With ``offload_activations`` the tensors it keeps go to
(pinned) CPU memory on an accelerator; on the CPU there is nothing to move.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mpar import _device
from mpar.config import Config

__all__ = ["run_stage"]


def run_stage(
    stage: torch.nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, Any],  # passed on to checkpoint(), whose own keywords are typed
    config: Config,
    device: torch.device,
) -> object:
    """``stage(*args, **kwargs)``, recomputed in backward when checkpointing is on."""
    if not config.checkpointing or not torch.is_grad_enabled():
        return stage(*args, **kwargs)
    _device.prepare_recompute(device)
    offload: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if config.offload_activations:
        offload = _device.activation_offload(device)
    with offload:
        return checkpoint(stage, *args, use_reentrant=False, **kwargs)
