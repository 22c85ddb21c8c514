"""The targets of a mean loss, and how many each microbatch keeps.

A loss over ``labels`` with ``-100`` for "no target" (``F.cross_entropy``'s default,
Hugging Face's losses) is a mean over the targets kept, not over the samples: a
microbatch (or data-parallel replica) keeping more targets counts for more. Weighing
microbatches by their kept targets, not their samples, makes the step one process's
mean over every kept target of the batch (``mpar.runtime._microbatch``).

A Hugging Face causal LM called with ``labels`` shifts them by one token inside its
loss: its kept targets are ``labels[..., 1:]``'s. Other losses count ``labels`` as they
are (a loss computed in the step function is over targets aligned with the inputs, as
context parallelism asks too).

Tensors are found by name, as context parallelism finds them: an argument of the step
function or a dict key called ``labels`` (or ``shift_labels``, already shifted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "Leaf",
    "count_targets",
    "find_named",
    "is_causal_lm",
    "named_leaves",
]

IGNORE_INDEX = -100
"""The label of a token without a target (Hugging Face's and ``F.cross_entropy``'s)."""

Leaf = tuple[str, torch.Tensor]
"""A tensor and the name it was found under."""


def is_causal_lm(module: nn.Module) -> bool:
    """A Hugging Face causal LM: its loss shifts ``labels`` along the sequence."""
    name = type(module).__name__
    return getattr(module, "loss_type", None) == "ForCausalLM" or (
        hasattr(module, "loss_function") and name.endswith(("ForCausalLM", "LMHeadModel"))
    )


def _leaves(value: object, name: str, out: list[Leaf]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((name, value))
    elif isinstance(value, tuple | list):
        for item in value:
            _leaves(item, name, out)
    elif isinstance(value, dict):
        for key, item in value.items():
            _leaves(item, str(key), out)


def named_leaves(
    args: Sequence[object], kwargs: dict[str, object], names: Sequence[str]
) -> list[Leaf]:
    """Every tensor of a call, named by its argument (``names``: the positional
    parameters' names) or, inside a dict, by its key."""
    found: list[Leaf] = []
    for i, value in enumerate(args):
        _leaves(value, names[i] if i < len(names) else f"argument {i}", found)
    for key, value in kwargs.items():
        _leaves(value, key, found)
    return found


def find_named(leaves: list[Leaf], name: str) -> torch.Tensor | None:
    """The first tensor called ``name``, or None."""
    return next((t for n, t in leaves if n == name), None)


def count_targets(
    causal_lm: bool,
    args: Sequence[tuple[object, ...]],
    kwargs: Sequence[dict[str, object]],
    names: Sequence[str],
) -> torch.Tensor | None:
    """Each microbatch's kept targets, as ``[microbatches, 2]`` int64 where the labels
    are: column 0 counts ``labels`` as they are (a loss the step function computes),
    column 1 what the model's own loss keeps when called with them (``causal_lm``: a
    Hugging Face causal LM's ``labels[..., 1:]``; ``shift_labels`` as they are). None
    where a microbatch holds no integer tensor named ``labels`` nor ``shift_labels``."""
    counts: list[torch.Tensor] = []
    for a, k in zip(args, kwargs, strict=True):
        leaves = named_leaves(a, k, names)
        labels = find_named(leaves, "labels")
        shifted = find_named(leaves, "shift_labels")
        if shifted is None and labels is not None and labels.dim() > 0:
            shifted = labels[..., 1:] if causal_lm else labels
        plain = labels if labels is not None and labels.dim() > 0 else shifted
        if plain is None or shifted is None or not _indices(plain) or not _indices(shifted):
            return None
        counts.append(torch.stack([plain.ne(IGNORE_INDEX).sum(), shifted.ne(IGNORE_INDEX).sum()]))
    return torch.stack(counts) if counts else None


def _indices(t: torch.Tensor) -> bool:
    """Class indices (not a regression's or soft labels)."""
    return not (t.is_floating_point() or t.is_complex())
