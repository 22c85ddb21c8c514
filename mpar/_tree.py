"""Walking nested values: tensors inside tuples, lists, namedtuples and dicts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["tree_leaves", "tree_map"]


def tree_map(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)``; other leaves kept."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        items = [tree_map(fn, v) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, tree_map(fn, v)) for k, v in value.items())
    return value


def tree_leaves(value: Any) -> Iterator[Any]:
    """Every leaf (tensor or not) of ``value``, depth first."""
    if isinstance(value, tuple | list):
        for item in value:
            yield from tree_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tree_leaves(item)
    else:
        yield value
