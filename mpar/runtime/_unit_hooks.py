"""Placing the unit-group hooks of ZeRO 2/3 (``mpar.shard._unit_gather``) on a rank's stages.

``zero.gather`` decides the groups: ``"unit"`` (default) one partition unit
each, an int ``n`` groups of ``n`` consecutive units, ``"chunk"`` no groups
(the whole stage is gathered at once, reduced once per step, as before).
Schedules with a split backward (I/W actions) gather by chunk: their weight
gradients are computed after the input gradients, outside the hooks' order.

Traced stages get gates in their graph
(:meth:`~mpar.partition._traced.TracedStage.install_unit_gates`), which also
say which group alone reads each parameter. Stages that keep the original
modules (the whole model at ``pipeline_parallel_degree`` 1, children of an
``nn.Sequential``) get forward hooks on the unit submodules; a parameter
belongs to a group when it is under exactly one unit module, which runs once
per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mpar._tree import tree_leaves, tree_map
from mpar.partition._gates import GATE_ATTR, enter, leave
from mpar.shard._unit_gather import UnitGather

__all__ = ["group_units", "install_groups"]

T = TypeVar("T")
Gate = UnitGather | None
"""What unit-group hooks call (None until ZeRO sharding exists)."""
GateHook = Callable[..., tuple[torch.Tensor, ...]]
"""``enter`` or ``leave`` of :mod:`mpar.partition._gates`: ``hook(gate, g, *tensors)``."""


def group_units(units: Sequence[str], gather: str | int) -> list[list[str]]:
    """Consecutive ``units`` in groups of ``gather`` (``"unit"``: one each)."""
    size = 1 if gather == "unit" else int(gather)
    return [list(units[i : i + size]) for i in range(0, len(units), size)]


def _tensors_through(fn: GateHook, gate: Gate, g: int, value: T) -> T:
    """``value`` with its tensors passed through ``fn(gate, g, *tensors)``."""
    leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    passed = iter(fn(gate, g, *leaves))
    return tree_map(lambda _t: next(passed), value)


def _module_groups(
    stage: nn.Module, groups: list[list[str]]
) -> tuple[list[list[tuple[str, nn.Module]]], dict[int, int | None]]:
    """Each group's (name, module) units, and ``id(param) -> group`` by module tree."""
    modules: list[list[tuple[str, nn.Module]]] = []
    seen: dict[int, int] = {}
    for names in groups:
        found = [(n, stage.get_submodule(n)) for n in names]
        modules.append(found)
        for _, m in found:
            seen[id(m)] = seen.get(id(m), 0) + 1
    owner: dict[int, int | None] = {}
    for g, found in enumerate(modules):
        for _, m in found:
            shared = seen[id(m)] > 1  # one module object under two unit names
            for p in m.parameters():
                claim = None if shared else g
                owner[id(p)] = claim if owner.get(id(p), claim) == claim else None
    for p in stage.parameters():
        owner.setdefault(id(p), None)
    return modules, owner


class ModuleGroupHooks:
    """Forward hooks on unit submodules calling a gate's group hooks."""

    def __init__(self, modules: list[list[tuple[str, nn.Module]]]) -> None:
        self.modules = modules
        self.handles: list[RemovableHandle] = []

    def install(self, gate: Gate) -> None:
        for g, found in enumerate(self.modules):
            if not found:
                continue
            first, last = found[0][1], found[-1][1]

            def pre(
                _m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], g: int = g
            ) -> tuple[tuple[object, ...], dict[str, object]]:
                return _tensors_through(enter, gate, g, (args, kwargs))

            def post(_m: nn.Module, _a: object, _kw: object, out: object, g: int = g) -> object:
                return _tensors_through(leave, gate, g, out)

            self.handles.append(first.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(last.register_forward_hook(post, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _embedding_tables(modules: list[list[tuple[str, nn.Module]]]) -> set[int]:
    """``id`` of the weights of the plain ``nn.Embedding`` units (no ``max_norm``,
    which rewrites the table, and no subclass forward): their backward reads none
    of their values."""
    return {
        id(m.weight)
        for found in modules
        for _, m in found
        if isinstance(m, nn.Embedding)
        and type(m).forward is nn.Embedding.forward
        and m.max_norm is None
    }


def install_groups(
    stage: nn.Module, groups: list[list[str]]
) -> tuple[Callable[[Gate], None], dict[int, int | None], frozenset[int]]:
    """Prepare ``stage`` for unit-group hooks; returns ``(installer, owner, unread)``.

    ``installer(gate)`` connects the hooks to ``gate`` once it exists;
    ``owner`` maps ``id(param)`` to the group that alone uses it (or None);
    ``unread`` holds the ``id`` of the parameters whose gradient needs none of
    their values (embedding tables).
    """
    from mpar.partition._traced import TracedStage

    if isinstance(stage, TracedStage):
        owner = stage.install_unit_gates(groups, None)

        def connect(gate: Gate) -> None:
            object.__setattr__(stage, GATE_ATTR, gate)

        return connect, owner, stage.unread_in_backward
    modules, owner = _module_groups(stage, groups)
    hooks = ModuleGroupHooks(modules)
    return hooks.install, owner, frozenset(_embedding_tables(modules))
