"""Swapping a tensor's storage while every reference to the Python object stays valid."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["replace_storage", "twin"]


def twin(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A tensor object like ``t`` (Parameter or not, same attributes) holding ``data``."""
    if isinstance(t, nn.Parameter):
        out: torch.Tensor = nn.Parameter(data, requires_grad=t.requires_grad)
    else:
        out = data
    for key, value in t.__dict__.items():
        if key != "_is_hf_initialized":  # transformers skips tensors it has set
            out.__dict__[key] = value
    return out


def replace_storage(t: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``t`` (the same Python object everywhere it is referenced) hold ``data``."""
    torch.utils.swap_tensors(t, twin(t, data))
