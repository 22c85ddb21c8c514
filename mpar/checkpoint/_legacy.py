"""Loading single-file checkpoints of the earlier format ("mpar-gathered-v1").

Such a file holds the gathered model state (original keys) and the optimizer
state in the unwrapped optimizer's format; it still loads into any layout.
To convert one to the directory format, load it and save again::

    mpar.load_checkpoint("old.pt", model, optimizer)
    mpar.save_checkpoint("ckpt", model, optimizer)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mpar.runtime import DistributedModel, DistributedOptimizer

__all__ = ["GATHERED_FORMAT", "load_gathered"]

GATHERED_FORMAT = "mpar-gathered-v1"


def load_gathered(
    path: Path, model: DistributedModel, optimizer: DistributedOptimizer | None
) -> object:
    """Load a single-file checkpoint; returns its ``user_content``. Raises ValueError
    naming the file when it is not one."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != GATHERED_FORMAT:
        raise ValueError(
            f"{str(path)!r} is not an mpar checkpoint (a file must have format "
            f"{GATHERED_FORMAT!r}; a checkpoint saved by mpar.save_checkpoint is a directory)"
        )
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {str(path)!r} holds no optimizer state")
        optimizer.load_state_dict(payload["optimizer"])
    return payload["user_content"]
