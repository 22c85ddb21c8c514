"""Initialising a model built on the meta device, the same values in every layout.

The model is cut into *init groups*: each partition unit (``find_units``
without inputs: a transformer block, an embedding, ...) is one group with the
parameters and buffers of its subtree, and each module above the units that
holds tensors itself is a group of its own tensors. A tensor belongs to the
group of its canonical (first registered) name, so a tied weight is
initialised once, by the module that owns it first.

A group is initialised alone: its tensors get fresh storage filled with a value
no initialiser leaves (NaN; an integer's extreme; for bool, a byte that is neither
0 nor 1), every other tensor the initialisers could reach
is presented as meta (writes to it are no-ops, it draws no random numbers), and
the group's modules run their own initialisers children first (the order of
``nn.Module.apply``), each under ``torch.manual_seed`` of a stable hash of
``(seed, module name)``. So a tensor's value depends only on the seed and its
name, never on which rank builds it, in what order, or what else exists there:
pipeline, data-parallel, ZeRO and virtual-stage layouts all give the same
values, and so does :func:`materialize` in one process. A tensor still holding
the fill afterwards had no initialiser (a bool causal mask computed in
``__init__``, say): an error names it and the fix.

Initialisers, per module: a user ``init_fn(module)`` first; then, when there is
none or it set none of the module's tensors, inside a Hugging Face
``PreTrainedModel`` its ``_init_weights(module)`` (which in transformers 5 also
recomputes buffers such as rotary ``inv_freq`` and BERT's ``position_ids``), then
``reset_parameters()`` where that left a tensor unset; else ``reset_parameters()``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpar._swap import replace_storage
from mpar._swap import twin as _twin
from mpar.errors import MparError
from mpar.partition._split import _original_names

__all__ = [
    "InitError",
    "InitFn",
    "InitGroup",
    "init_groups",
    "initialize_group",
    "stable_seed",
]

InitFn = Callable[[nn.Module], None]


class InitError(MparError, ValueError):
    """A tensor of a meta-built model that no initialiser set."""


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from ``seed`` and ``name``, the same in every process and run."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class InitGroup:
    """Tensors initialised together, and the modules whose initialisers run."""

    name: str
    modules: list[tuple[str, nn.Module]]
    """(qualified name, module), children before parents."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Canonical name -> tensor (parameters and buffers) this group sets."""
    scope: list[torch.Tensor] = field(default_factory=list)
    """Every tensor the group's initialisers can reach (the subtree's)."""


def _post_order(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def _direct(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


def init_groups(module: nn.Module) -> list[InitGroup]:
    """The init groups of ``module``: modules above the units first, then units."""
    from mpar.partition import find_units

    units = find_units(module)
    canonical = _original_names(module)  # id -> first name: the canonical one
    seen: set[int] = set()
    unit_groups: list[InitGroup] = []
    for unit in units:
        sub = module.get_submodule(unit)
        if id(sub) in seen:
            continue  # the same module under a second name (shared embeddings)
        mods = list(_post_order(sub, unit, seen))
        unit_groups.append(InitGroup(unit, mods))
    outer: list[InitGroup] = []
    for name, m in module.named_modules():
        if id(m) not in seen and _direct(m):
            outer.append(InitGroup(name, [(name, m)]))
    groups = outer + unit_groups
    by_module = {id(m): g for g in groups for _, m in g.modules}
    for name, m in module.named_modules(remove_duplicate=False):
        group = by_module.get(id(m))
        for t in _direct(m):
            if group is not None and _owner_prefix(canonical[id(t)], name, m, t):
                group.tensors.setdefault(canonical[id(t)], t)
    for g in groups:
        subtree = g.modules if g in unit_groups else list(_post_order(g.modules[0][1], "", set()))
        ids: set[int] = set()
        for _, m in subtree:
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if id(t) not in ids:
                    ids.add(id(t))
                    g.scope.append(t)
    return [g for g in groups if g.tensors]


def _owner_prefix(
    canonical: str, module_name: str, module: nn.Module, tensor: torch.Tensor
) -> bool:
    """Whether ``module`` (at ``module_name``) is where the canonical name registers ``tensor``."""
    prefix, _, leaf = canonical.rpartition(".")
    return prefix == module_name and (
        module._parameters.get(leaf) is tensor or module._buffers.get(leaf) is tensor
    )


# ---------------------------------------------------------------------------- storage


_UNSET_BOOL = 0xFF
"""The byte a fresh bool tensor holds: never a bool value (0 or 1), so any write shows."""


def _sentinel(dtype: torch.dtype) -> int:
    """The fill of fresh integer storage: the minimum (the maximum for unsigned types,
    whose minimum 0 is a common initial value)."""
    info = torch.iinfo(dtype)
    return info.max if info.min == 0 else info.min


def _fresh(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """New CPU storage for ``t`` filled with a value no initialiser leaves behind: NaN,
    an integer's extreme, a byte that is no bool (:data:`_UNSET_BOOL`)."""
    data = torch.empty(shape, dtype=t.dtype, device="cpu")
    if data.is_floating_point() or data.is_complex():
        data.fill_(float("nan"))
    elif data.dtype == torch.bool:
        data.view(torch.uint8).fill_(_UNSET_BOOL)
    else:
        data.fill_(_sentinel(data.dtype))
    return data


def unset(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds :func:`_fresh`'s fill somewhere."""
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return bool((t.view(torch.uint8) > 1).any())
    return bool((t == _sentinel(t.dtype)).any())


@contextmanager
def _as_meta(tensors: list[torch.Tensor], shapes: dict[int, torch.Size]) -> Iterator[None]:
    """Present ``tensors`` as meta tensors (of their full shapes) while inside."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for t in tensors:
            twin = _twin(t, torch.empty(shapes.get(id(t), t.shape), dtype=t.dtype, device="meta"))
            torch.utils.swap_tensors(t, twin)
            swapped.append((t, twin))
        yield
    finally:
        for t, twin in reversed(swapped):
            torch.utils.swap_tensors(t, twin)


# ---------------------------------------------------------------------------- initialisers


def _hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the nearest Hugging Face PreTrainedModel at or above it."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional
        return {}
    out: dict[int, nn.Module] = {}

    def walk(m: nn.Module, owner: nn.Module | None) -> None:
        owner = m if isinstance(m, PreTrainedModel) else owner
        if owner is not None:
            out.setdefault(id(m), owner)
        for child in m.children():
            walk(child, owner)

    walk(root, None)
    return out


def _hf_guard() -> contextlib.AbstractContextManager[Any]:
    """transformers 5's guard: torch.nn.init functions skip tensors it marks as set."""
    try:
        from transformers import initialization
    except ImportError:  # older transformers: no guard needed
        return contextlib.nullcontext()
    return initialization.guard_torch_init_functions()


def _own_initialisers(root: nn.Module) -> Callable[[nn.Module], None]:
    """A module's own initialisers: Hugging Face ``_init_weights`` inside a
    ``PreTrainedModel`` (then ``reset_parameters()`` where that left a tensor unset),
    else ``reset_parameters()``."""
    owners = _hf_owners(root)

    def run(m: nn.Module) -> None:
        owner = owners.get(id(m))
        if owner is not None:
            with _hf_guard():
                owner._init_weights(m)  # type: ignore[operator]
            if not any(unset(t) for t in _direct(m) if not t.is_meta):
                return
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()

    return run


def module_initializer(root: nn.Module, init_fn: InitFn | None) -> Callable[[nn.Module], None]:
    """The function that initialises one module of ``root``: ``init_fn(module)`` first
    when given; the module's own initialisers (:func:`_own_initialisers`) when there is
    no ``init_fn`` or it set none of the module's tensors. So an ``init_fn`` only needs
    to cover the modules the model's initialisers miss (a buffer computed in
    ``__init__``)."""
    own = _own_initialisers(root)
    if init_fn is None:
        return own

    def run(m: nn.Module) -> None:
        fresh = [t for t in _direct(m) if not t.is_meta and unset(t)]
        init_fn(m)
        if fresh and all(unset(t) for t in fresh):
            own(m)

    return run


def initialize_group(
    group: InitGroup,
    *,
    seed: int,
    run: Callable[[nn.Module], None],
    shapes: dict[int, torch.Size],
    keep: Callable[[torch.Tensor], bool] = lambda t: True,
) -> None:
    """Give ``group``'s meta tensors fresh CPU storage and initialise them (see the
    module docstring). Tensors for which ``keep`` is false go back to meta after."""
    fresh = [(n, t) for n, t in group.tensors.items() if t.is_meta]
    if not fresh:
        return
    fresh_ids = {id(t) for _, t in fresh}
    others = [t for t in group.scope if id(t) not in fresh_ids and not t.is_meta]
    for _, t in fresh:
        replace_storage(t, _fresh(t, shapes.get(id(t), t.shape)))
    with _as_meta(others, shapes), torch.no_grad(), torch.random.fork_rng(devices=[]):
        for name, m in group.modules:
            torch.manual_seed(stable_seed(seed, name))
            run(m)
    for name, t in fresh:
        if unset(t):
            raise InitError(_not_set(name, t, group))
        if not keep(t):
            replace_storage(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))


def _not_set(name: str, t: torch.Tensor, group: InitGroup) -> str:
    """The error for tensor ``name`` that no initialiser set, with the fix."""
    owner = name.rpartition(".")[0]
    module = dict(group.modules).get(owner)
    kind = type(module).__name__ if module is not None else "its module"
    what = "buffer" if not isinstance(t, nn.Parameter) else "parameter"
    return (
        f"{name} ({tuple(t.shape)}, {t.dtype}), a {what} of a model built on the meta "
        "device, was not set by any initialiser (Hugging Face _init_weights, "
        "reset_parameters): a value computed in __init__ (a causal mask, a lookup table) "
        "is lost on the meta device. Pass init_fn=callable(module) to "
        "mpar.DistributedModel / mpar.materialize that sets it, e.g. for modules of type "
        f"{kind}: module.{name.rpartition('.')[2]}.copy_(<the value __init__ computes>); "
        "modules init_fn leaves untouched keep their own initialisers"
    )
