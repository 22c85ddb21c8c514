"""Flatten a model into an execution-ordered list of partitionable units.

A *unit* is a submodule (named by its qualified name) that the partitioner never
cuts through. The rules, in order:

* the root ``nn.Sequential`` → its children;
* a container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) whose
  children are modules → expanded into its children (``transformer.h`` →
  ``transformer.h.0`` … ``transformer.h.11``);
* a module that holds, anywhere below it, a ``nn.ModuleList`` of two or more
  blocks (GPT-2's ``transformer``, BERT's ``bert`` and ``bert.encoder``) →
  expanded into its children;
* a child ``nn.Sequential`` of two or more modules of one type (ResNet's
  ``layer1``) → expanded into its children;
* any other module is a unit;
* a model whose rules leave one unit that has children (a wrapper:
  ``self.net = nn.Sequential(...)`` beside modules that never run) → that unit
  expanded by the same rules, as if it were the root, when that gives two or more.

So Hugging Face ``GPT2LMHeadModel`` gives ``transformer.wte``,
``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` …
``transformer.h.11``, ``transformer.ln_f``, ``lm_head``.

With example inputs the units are ordered by a forward pass (forward pre-hooks
record the first call of each) and units that never run are dropped; without
them the order is registration order, which is execution order for nearly
every model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["find_units", "unit_modules"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _has_block_list(module: nn.Module) -> bool:
    """Whether ``module`` or a descendant is a ModuleList of two or more modules."""
    return any(isinstance(m, nn.ModuleList) and len(m) >= 2 for m in module.modules())


def _homogeneous_sequential(module: nn.Module) -> bool:
    children = list(module.children())
    return (
        isinstance(module, nn.Sequential)
        and len(children) >= 2
        and len({type(c) for c in children}) == 1
        and any(True for _ in children[0].children())
    )


def _expand(module: nn.Module, is_root: bool) -> bool:
    if not any(True for _ in module.children()):
        return False
    if is_root or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return True
    return _has_block_list(module) or _homogeneous_sequential(module)


def _collect(module: nn.Module, prefix: str, is_root: bool, out: list[str]) -> None:
    if not _expand(module, is_root):
        out.append(prefix)
        return
    for name, child in module.named_children():
        _collect(child, f"{prefix}.{name}" if prefix else name, False, out)


def _execution_order(
    module: nn.Module,
    names: Sequence[str],
    example_args: Sequence[object],
    example_kwargs: Mapping[str, object] | None,
) -> list[str]:
    order: dict[str, None] = {}
    handles = []
    for name in names:

        def hook(_mod: nn.Module, _args: tuple[object, ...], name: str = name) -> None:
            order.setdefault(name, None)

        handles.append(module.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            module(*example_args, **dict(example_kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()
    return list(order)


def find_units(
    module: nn.Module,
    example_args: Sequence[object] | None = None,
    example_kwargs: Mapping[str, object] | None = None,
) -> list[str]:
    """The execution-ordered qualified names of ``module``'s partitionable units.

    Args:
        module: the model.
        example_args, example_kwargs: optional inputs; when given, a forward pass
            (under ``torch.no_grad``) orders the units by their first call and
            drops units that never run.

    Returns:
        Qualified names such as ``["transformer.wte", ..., "lm_head"]``; a model
        without children is a single unit named ``""``.
    """
    names = _units_below(module, "", example_args, example_kwargs)
    while len(names) == 1 and any(True for _ in module.get_submodule(names[0]).children()):
        inner = _units_below(module, names[0], example_args, example_kwargs)
        if len(inner) < 2:
            break
        names = inner
    return names


def _units_below(
    module: nn.Module,
    prefix: str,
    example_args: Sequence[object] | None,
    example_kwargs: Mapping[str, object] | None,
) -> list[str]:
    """The units of ``module.get_submodule(prefix)`` expanded as a root, in execution order
    when example inputs are given (a forward pass of the whole ``module``)."""
    names: list[str] = []
    _collect(module.get_submodule(prefix), prefix, True, names)
    if example_args is None and example_kwargs is None:
        return names
    return _execution_order(module, names, tuple(example_args or ()), example_kwargs)


def unit_modules(module: nn.Module, units: Sequence[str]) -> list[nn.Module]:
    """The submodules named by ``units`` (``""`` is the root)."""
    return [module.get_submodule(name) for name in units]
