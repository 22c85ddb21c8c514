"""Manual placement: ``with mpar.partition(i):`` and the boundaries it implies.

While a ``partition(i)`` context is active, a global module-registration hook
(``torch.nn.modules.module.register_module_module_registration_hook``) records
every submodule *assigned to a parent* (``self.block = Block()``) as belonging
to stage ``i``. Submodules registered inside a child's constructor are recorded
too, so::

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with mpar.partition(0):
                self.embed = nn.Embedding(100, 16)
                self.blocks = nn.ModuleList(Block() for _ in range(4))
            with mpar.partition(1):
                self.head = nn.Linear(16, 100)

places ``embed`` and ``blocks.*`` on stage 0 and ``head`` on stage 1. A module
created inside the context but attached to its parent outside it is not seen;
attach it inside. Nested contexts: the innermost wins.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

from mpar.errors import PartitionError

__all__ = ["assigned_stage", "manual_boundaries", "partition"]

_assignments: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_state = threading.local()
_hook_lock = threading.Lock()


class _Hook:
    """The global registration hook, installed while any ``partition`` context is open."""

    count = 0
    handle: RemovableHandle | None = None


def _stack() -> list[int]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    stack: list[int] = _state.stack
    return stack


def _on_register(_parent: nn.Module, _name: str, child: nn.Module | None) -> None:
    stack = _stack()
    if stack and child is not None:
        _assignments[child] = stack[-1]
        for sub in child.modules():  # children built before they joined this parent
            _assignments.setdefault(sub, stack[-1])


def _acquire_hook() -> None:
    with _hook_lock:
        if _Hook.count == 0:
            _Hook.handle = register_module_module_registration_hook(_on_register)
        _Hook.count += 1


def _release_hook() -> None:
    with _hook_lock:
        _Hook.count -= 1
        if _Hook.count == 0 and _Hook.handle is not None:
            _Hook.handle.remove()
            _Hook.handle = None


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place modules registered inside this context on pipeline stage ``index``.

    Used when ``auto_partition`` is false; see ``manual_boundaries``.
    """
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise PartitionError(f"partition index must be an integer >= 0, got {index!r}")
    _acquire_hook()
    _stack().append(index)
    try:
        yield
    finally:
        _stack().pop()
        _release_hook()


def assigned_stage(module: nn.Module) -> int | None:
    """The stage recorded for ``module`` by ``partition(i)``, or None."""
    return _assignments.get(module)


def _unit_stage(root: nn.Module, name: str) -> int | None:
    """The recorded stage of a unit: its own, else its nearest placed ancestor's."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        stage = _assignments.get(root.get_submodule(".".join(parts[:depth])))
        if stage is not None:
            return stage
    return None


def manual_boundaries(module: nn.Module, units: Sequence[str], *, default: int = 0) -> list[int]:
    """Stage start indices from ``partition(i)`` placements of ``units`` (in execution order).

    A unit without a placement (nor a placed ancestor) goes to stage ``default`` when
    that is above 0 (smp's ``default_partition``: where modules created outside any
    ``partition(i)`` go); with 0, the default, it joins the stage of the unit before
    it (the first unit: stage 0). Raises PartitionError when the stages do not appear
    in order 0, 1, 2, ... along the execution order.
    """
    stages: list[int] = []
    for name in units:
        stage = _unit_stage(module, name)
        if stage is None:
            stage = default if default > 0 else stages[-1] if stages else 0
        stages.append(stage)
    starts = [0]
    for i in range(1, len(stages)):
        if stages[i] == stages[i - 1]:
            continue
        if stages[i] != stages[i - 1] + 1:
            raise PartitionError(
                f"manual placement is not contiguous in execution order: unit "
                f"{units[i]!r} is on stage {stages[i]} but runs right after {units[i - 1]!r} "
                f"on stage {stages[i - 1]}; stages must follow 0, 1, 2, ... along the "
                "forward pass — move it into the right `with mpar.partition(i)` block"
            )
        starts.append(i)
    if stages and stages[0] != 0:
        raise PartitionError(
            f"manual placement starts on stage {stages[0]} (unit {units[0]!r}); the first "
            "unit to run must be on stage 0"
        )
    return starts
