"""Walking nested values: tensors inside tuples, lists, namedtuples and dicts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["tree_leaves", "tree_map"]

T = TypeVar("T")


def tree_map(fn: Callable[[Any], Any], value: T, *, leaf: type = torch.Tensor) -> T:
    """``value`` with every ``leaf`` instance ``t`` (a tensor by default) replaced by
    ``fn(t)``, visited depth first in order; other leaves are kept."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, tuple | list):
        items = [tree_map(fn, v, leaf=leaf) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, tree_map(fn, v, leaf=leaf)) for k, v in value.items())
    return value


def tree_leaves(value: object) -> Iterator[Any]:
    """Every leaf (tensor or not) of ``value``, depth first."""
    if isinstance(value, tuple | list):
        for item in value:
            yield from tree_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tree_leaves(item)
    else:
        yield value
