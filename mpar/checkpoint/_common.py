"""What saving and loading share: the format name, the error type, agreement."""

from __future__ import annotations

from typing import Any

from mpar.comm._checkpoint_comm import all_gather_object_in
from mpar.comm._types import ProcessGroup
from mpar.errors import MparError

__all__ = ["FORMAT", "CheckpointError", "agree", "check_model"]

FORMAT = "mpar-dcp-v1"


class CheckpointError(MparError, ValueError):
    """A checkpoint is missing, incomplete, unreadable, or does not fit the model."""


def agree(error: str | None, group: ProcessGroup | None, what: str) -> None:
    """Every rank raises if any rank failed (its message), instead of hanging."""
    errors = [(r, e) for r, e in enumerate(all_gather_object_in(error, group)) if e]
    if errors:
        rank, text = errors[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {text}")


def check_model(model: Any, optimizer: Any) -> None:
    from mpar.runtime import DistributedModel, DistributedOptimizer

    if not isinstance(model, DistributedModel):
        raise TypeError(f"model must be an mpar.DistributedModel, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"optimizer must be an mpar.DistributedOptimizer or None, got {type(optimizer).__name__}"
        )
