"""Capture a model as one ATen graph with ``torch.export``, in a chosen train/eval mode.

Dynamic shapes: every axis in ``dynamic_axes`` (default: axis 0, the batch) of
every tensor input is exported as ``Dim.AUTO(min=1)``, so the graph accepts any
size of that axis the model's code allows. ``Dim.AUTO`` never fails the export:
an axis the model pins (``x.view(4, ...)``) silently becomes static, and one
the model bounds (BERT's positions) gets a range; the stage input check then
rejects other sizes with a message naming the input and the axis.

``torch.export`` specialises sizes 0 and 1, so an example whose dynamic axis has
size 1 (a microbatch of one) is enlarged to 2 by repeating it along that axis for
the capture only; values do not matter to the graph (the non-strict export runs
on fake tensors) unless the model branches on them, which export rejects anyway.
An example that is a view (``tokens[:, :-1]``) is exported as a contiguous copy:
export would otherwise guard on its base's sizes, and the next batch — a fresh
tensor of the same shape — would fail an internal ``Guard failed: idx._base``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import torch
from torch import nn

from mpar._compat import Dim, ExportedProgram, ShapesCollection, export, pytree
from mpar.errors import MparError, PartitionError

__all__ = ["capture"]


@contextmanager
def _mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Run with ``module`` in ``training`` mode unless it already is; restore every flag."""
    flags = {m: m.training for m in module.modules()}
    if module.training != training:
        module.train(training)
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def _enlarged(x: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    for axis in axes:
        if axis < x.dim() and x.shape[axis] == 1:
            x = x.repeat_interleave(2, dim=axis)
    return x


def _dynamic_inputs(
    module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], axes: Sequence[int]
) -> tuple[tuple[object, ...], dict[str, object], object]:
    """Example inputs safe to export dynamically, and their ``dynamic_shapes``."""

    def enlarge(leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf._base is not None or not leaf.is_contiguous():
            leaf = leaf.clone(memory_format=torch.contiguous_format)  # no view base: no guard on it
        return _enlarged(leaf, axes)

    args, kwargs = pytree.tree_map(enlarge, (args, kwargs))
    shapes = ShapesCollection()
    for leaf in pytree.tree_leaves((args, kwargs)):
        dims = [a for a in axes if isinstance(leaf, torch.Tensor) and a < leaf.dim()]
        if dims:
            shapes[leaf] = {a: Dim.AUTO(min=1) for a in dims}
    return args, kwargs, shapes.dynamic_shapes(module, args, kwargs)


def capture(
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    *,
    training: bool,
    dynamic_axes: Sequence[int],
) -> ExportedProgram:
    """``torch.export.export(strict=False)`` of ``module`` in ``training`` mode.

    Raises:
        PartitionError: the model cannot be captured as one graph.
    """
    for attempt in range(2):
        try:
            ex_args, ex_kwargs, dynamic = _dynamic_inputs(module, args, kwargs, dynamic_axes)
            with _mode(module, training):
                return export(module, ex_args, ex_kwargs, dynamic_shapes=dynamic, strict=False)
        except MparError:
            raise  # mpar's own (a sequence not divisible by tp, say) names its cause already
        except Exception as exc:  # torch.export raises many types; report them all alike
            if attempt == 0 and _registered_dataclass(exc):
                continue
            _refuse(module, training, exc)
    raise AssertionError("unreachable: the second attempt returns or raises")


_UNKNOWN_TYPE = re.compile(r"Found <class '([\w.]+)'> in (?:output|input)")


def _registered_dataclass(exc: Exception) -> bool:
    """When export failed on a dataclass it does not know (a model returning
    ``Output(logits=..., aux=...)``), register it as a pytree node
    (``torch.export.register_dataclass``) and say so: the capture is tried again."""
    found = _UNKNOWN_TYPE.search(str(exc))
    if found is None:
        return False
    module_name, _, name = found.group(1).rpartition(".")
    cls = getattr(sys.modules.get(module_name), name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return False
    torch.export.register_dataclass(cls)
    return True


def _refuse(module: nn.Module, training: bool, exc: Exception) -> NoReturn:
    """Raise the :class:`PartitionError` for an export that failed with ``exc``."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    hint = " Remove data-dependent control flow or graph breaks, or give an nn.Sequential."
    if _UNKNOWN_TYPE.search(text):
        hint = (
            " Return (and take) tensors in tuples, lists, dicts or dataclasses, or register"
            " the type as a pytree node (torch.utils._pytree.register_pytree_node)."
        )
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        hint += " For Hugging Face models set config.use_cache = False."
    mode = "train" if training else "eval"
    raise PartitionError(
        f"cannot split {type(module).__name__}: torch.export could not capture it as "
        f"one graph in {mode} mode ({type(exc).__name__}: {first[:300]}).{hint}"
    ) from exc
