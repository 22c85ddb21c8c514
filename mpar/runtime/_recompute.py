"""Running a stage's forward, optionally with activation checkpointing.

With ``activation_checkpointing`` true (``"each"``), a stage keeps only its inputs
during the forward pass and recomputes the forward inside its backward
(``torch.utils.checkpoint``, non-reentrant, RNG state restored so dropout
draws the same mask). With ``offload_activations`` the tensors it keeps go to
(pinned) CPU memory on an accelerator; on the CPU there is nothing to move.

Per block (``"block"``, ``"selective"``, ``{"mode": ..., "every": k}``),
:func:`checkpoint_blocks` makes each chosen partition unit of this rank's stages
recompute alone (:mod:`mpar.partition._block_checkpoint`): a traced stage outlines
the unit's span of its graph, a stage that is the model itself wraps the unit
module's ``forward``. The stage then runs as usual.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpar import _device
from mpar.config import BlockCheckpointing, Config
from mpar.partition._block_checkpoint import checkpoint_call, chosen_units

__all__ = ["checkpoint_blocks", "run_stage"]

_WRAPPED = "_mpar_checkpointed_forward"
"""Attribute of a unit module whose ``forward`` :func:`checkpoint_blocks` wrapped."""


def run_stage(
    stage: torch.nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, Any],  # passed on to checkpoint(), whose own keywords are typed
    config: Config,
    device: torch.device,
) -> object:
    """``stage(*args, **kwargs)``, recomputed in backward when checkpointing is on
    (the whole stage for ``"each"``; per block, the stage's own blocks recompute)."""
    if not config.checkpointing or not torch.is_grad_enabled():
        return stage(*args, **kwargs)
    _device.prepare_recompute(device)
    offload: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if config.offload_activations:
        offload = _device.activation_offload(device)
    with offload:
        if not config.chunk_checkpointing:
            return stage(*args, **kwargs)
        return checkpoint(stage, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(
    stage: nn.Module, units: Sequence[str], strategy: BlockCheckpointing
) -> list[str]:
    """Make ``stage``'s chosen ``units`` (its partition units, in order) recompute one
    by one in backward; returns the units checkpointed."""
    install = getattr(stage, "checkpoint_blocks", None)  # mpar.partition's TracedStage
    if callable(install):
        install(units, strategy)
        return chosen_units(units, strategy)
    chosen = chosen_units(units, strategy)
    for name in chosen:
        module = stage.get_submodule(name)
        if getattr(module, _WRAPPED, False):
            continue
        original = module.forward
        selective = strategy.mode == "selective"
        module.forward = functools.partial(checkpoint_call, original, selective)
        setattr(module, _WRAPPED, True)
    return chosen
