"""Splitting a step's arguments into microbatches.

Every tensor in the step function's arguments (also nested in lists, tuples
and dicts) is split along its batch axis (0, or ``input_split_axes[name]``)
into ``num_microbatches`` pieces with ``torch.tensor_split``, so an uneven
batch gives pieces whose sizes differ by at most one. Arguments named in
``non_split_inputs`` are passed whole to every microbatch. Each microbatch gets
a weight ``size / batch`` so that weighted sums over microbatches equal
whole-batch means; where the step's arguments hold integer ``labels``, the loss is a
mean over the targets kept (labels other than -100) and microbatches weigh by their
kept targets instead (:attr:`Microbatches.targets`, ``mpar._targets``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpar._cp_context import CPContext
from mpar.errors import StepError

__all__ = ["Microbatches", "split_microbatches"]


@dataclass
class Microbatches:
    """The per-microbatch ``(args, kwargs)`` and their weights."""

    args: list[tuple[object, ...]]
    kwargs: list[dict[str, object]]
    sizes: list[int]
    contexts: list[CPContext] | None = None
    """Under context parallelism: each microbatch's sequence split (``args``/``kwargs``
    hold this rank's tokens); None otherwise."""
    targets: torch.Tensor | None = None
    """Each microbatch's kept targets (labels other than -100), ``[microbatches, 2]``:
    for a loss the step function computes, and for the model's own loss
    (``mpar._targets.count_targets``); None without integer ``labels``."""
    total_targets: torch.Tensor | None = None
    """In a training step with :attr:`targets`: both columns summed over every
    microbatch of every data-parallel replica (each at least 1)."""

    def context(self, j: int) -> CPContext | None:
        """Microbatch ``j``'s context-parallel context, or None."""
        return None if self.contexts is None else self.contexts[j]

    @property
    def weights(self) -> list[float]:
        total = sum(self.sizes)
        return [size / total for size in self.sizes]

    def loss_weight(self, j: int, dp_size: int, *, own: bool) -> float | torch.Tensor:
        """What microbatch ``j``'s mean loss is multiplied by before its backward, so
        that the replicas' summed gradients are the global batch's: its share of every
        replica's kept targets where they are counted (``own``: the loss is the model's
        own, called with ``labels``; a tensor where the targets are, no host
        synchronization), else its share of the batch's samples over ``dp_size``."""
        if self.targets is not None and self.total_targets is not None:
            column = 1 if own else 0
            return self.targets[j, column] / self.total_targets[column]
        return self.weights[j] / dp_size

    def __len__(self) -> int:
        return len(self.sizes)


def _batch_sizes(value: object, axis: int, name: str, found: list[tuple[str, int]]) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise StepError(
                f"step argument {name!r} holds a 0-dimensional tensor, which cannot be split "
                f"into microbatches; list it in non_split_inputs"
            )
        if not -value.dim() <= axis < value.dim():
            raise StepError(
                f"step argument {name!r} has {value.dim()} dimensions; cannot split along "
                f"axis {axis} (set input_split_axes={{{name!r}: <axis>}})"
            )
        found.append((name, value.shape[axis]))
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            _batch_sizes(item, axis, f"{name}[{i}]", found)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _batch_sizes(item, axis, f"{name}[{key!r}]", found)


def _split_value(value: object, axis: int, n: int) -> list[object]:
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, n, dim=axis))
    if isinstance(value, tuple | list):
        columns = [_split_value(item, axis, n) for item in value]
        rows = [[column[j] for column in columns] for j in range(n)]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            namedtuple: Callable[..., object] = type(value)
            return [namedtuple(*row) for row in rows]
        return [type(value)(row) for row in rows]
    if isinstance(value, Mapping):
        parts = {key: _split_value(item, axis, n) for key, item in value.items()}
        kind: Any = type(value) if isinstance(value, dict) else dict
        return [kind((key, parts[key][j]) for key in value) for j in range(n)]
    return [value] * n


def _bind(
    fn: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object]
) -> inspect.BoundArguments:
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"step function {fn.__name__!r} called with wrong arguments: {exc}"
        ) from None


def _check_names(
    bound: inspect.BoundArguments, non_split: Sequence[str], axes: Mapping[str, int], fn_name: str
) -> None:
    names = set(bound.signature.parameters)
    for name in list(non_split) + list(axes):
        if name not in names:
            raise StepError(
                f"@mpar.step option names argument {name!r}, but step function {fn_name!r} "
                f"has only {sorted(names)}"
            )


def split_microbatches(
    fn: Callable[..., object],
    args: Sequence[object],
    kwargs: Mapping[str, object],
    num_microbatches: int,
    *,
    non_split_inputs: Sequence[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
    skip_first: bool = True,
) -> Microbatches:
    """Split the arguments of ``fn`` (its first, the model, passed whole)."""
    axes = dict(input_split_axes or {})
    bound = _bind(fn, args, kwargs)
    _check_names(bound, non_split_inputs, axes, fn.__name__)
    params = list(bound.signature.parameters)
    whole = set(non_split_inputs) | ({params[0]} if skip_first and params else set())
    sizes: list[tuple[str, int]] = []
    for name, value in bound.arguments.items():
        if name not in whole:
            _batch_sizes(value, axes.get(name, 0), name, sizes)
    batch = _common_batch(sizes, num_microbatches, fn.__name__)
    pieces: dict[str, list[object]] = {}
    for name, value in bound.arguments.items():
        if name in whole:
            pieces[name] = [value] * num_microbatches
        else:
            pieces[name] = _split_value(value, axes.get(name, 0), num_microbatches)
    return _rebind(bound, pieces, num_microbatches, batch, drop_first=skip_first)


def _common_batch(sizes: list[tuple[str, int]], n: int, fn_name: str) -> int:
    if not sizes:
        raise StepError(
            f"step function {fn_name!r} got no tensor to split into {n} microbatches; "
            "pass the batch as tensor arguments"
        )
    batch = sizes[0][1]
    for name, size in sizes:
        if size != batch:
            raise StepError(
                f"step arguments have different batch sizes: {sizes[0][0]!r} has {batch}, "
                f"{name!r} has {size}; list arguments that are not batched in non_split_inputs "
                "or give their batch axis in input_split_axes"
            )
    if batch < n:
        raise StepError(
            f"batch of {batch} samples is smaller than microbatches={n}; use a batch of at "
            f"least {n} samples or fewer microbatches"
        )
    return batch


def _rebind(
    bound: inspect.BoundArguments,
    pieces: dict[str, list[object]],
    n: int,
    batch: int,
    *,
    drop_first: bool,
) -> Microbatches:
    sig = bound.signature
    all_args: list[tuple[object, ...]] = []
    all_kwargs: list[dict[str, object]] = []
    for j in range(n):
        local = sig.bind_partial()
        local.arguments.update({name: parts[j] for name, parts in pieces.items()})
        all_args.append(tuple(local.args)[1:] if drop_first else tuple(local.args))
        all_kwargs.append(dict(local.kwargs))
    base, extra = divmod(batch, n)
    sizes = [base + (1 if j < extra else 0) for j in range(n)]
    return Microbatches(all_args, all_kwargs, sizes)
