"""Checkpoints: ``mpar.save_checkpoint`` / ``mpar.load_checkpoint``.

A checkpoint holds the *gathered* model and optimizer state (the original
module's keys and the unwrapped optimizer's format), so it loads into any
layout — another pipeline degree, data-parallel size or ZeRO stage — and
into plain PyTorch (``torch.load(path, weights_only=True)["model"]``).

Writing is atomic: global rank 0 writes a temporary file in the same folder,
flushes it to disk and renames it over ``path``, so an interrupted save leaves
the previous checkpoint intact. Loading uses ``weights_only=True``: a
checkpoint cannot run code, and ``user_content`` must be made of tensors,
numbers, strings, lists, tuples and dicts.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from mpar.comm import state
from mpar.comm._collectives import barrier, broadcast_object_world
from mpar.errors import MparError

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

FORMAT = "mpar-gathered-v1"


class CheckpointError(MparError, ValueError):
    """A checkpoint file is missing, unreadable, or not an mpar checkpoint."""


def _write_atomically(payload: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    user_content: Any = None,
) -> None:
    """Save ``model`` (a DistributedModel), ``optimizer`` and ``user_content`` to ``path``.

    Collective: every rank calls it; global rank 0 writes the file.
    """
    st = state()
    payload = {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "user_content": user_content,
        "config": st.config.to_dict(),
    }
    error = None
    if st.layout.rank == 0:
        try:
            _write_atomically(payload, Path(path))
        except Exception as exc:  # every rank must hear about it, not hang
            error = f"{type(exc).__name__}: {exc}"
    error = broadcast_object_world(error, src=0)
    if error is not None:
        raise CheckpointError(f"saving checkpoint {str(path)!r} failed on rank 0: {error}")
    barrier()


def load_checkpoint(path: str | os.PathLike[str], model: Any, optimizer: Any = None) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint`; returns its ``user_content``.

    Works before or after the model is partitioned and across layouts.
    """
    state()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not an mpar checkpoint (expected format {FORMAT!r})"
        )
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no optimizer state")
        optimizer.load_state_dict(payload["optimizer"])
    return payload["user_content"]
