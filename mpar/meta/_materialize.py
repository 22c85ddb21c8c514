"""Materializing a model built on the meta device: in one process, or one rank's share.

``materialize(module)`` gives every tensor storage and initialises it (see
:mod:`mpar.meta._init`). A :class:`RankMaterializer` does the same for only the
tensors of one rank's pipeline stages, one init group (a partition unit) at a
time, as sharding asks for them: at ZeRO-3 a bucket takes its parameters'
values right after their group is initialised and drops them, so a stage never
exists unsharded on the rank.

Parameters stay the same Python objects throughout (the stages, the original
module and the optimizer all refer to them): storage is swapped in with
``torch.utils.swap_tensors``. That refuses tensors that something holds a weak
reference to: the fake-tensor modes of ``torch.export`` keep them in caches,
which :func:`drop_weak_refs` empties first.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mpar import _device
from mpar.meta._init import (
    InitError,
    InitFn,
    InitGroup,
    _twin,
    init_groups,
    initialize_group,
    module_initializer,
    replace_storage,
)

__all__ = [
    "RankMaterializer",
    "find_units_meta",
    "has_meta",
    "materialize",
    "renew_tensors",
    "tensor_shapes",
]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def find_units_meta(module: nn.Module, args: Any, kwargs: Mapping[str, Any]) -> list[str]:
    """``find_units`` run on fake tensors: of a meta model, or of a real one too large to
    run here (models that look at values, such as Hugging Face mask checks, skip
    those checks). Inputs go to meta for a meta model, stay where they are otherwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mpar.partition import find_units
    from mpar.profile import preserved_state

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    device = "meta" if has_meta(module) else None
    args, kwargs = pytree.tree_map(
        lambda x: (
            fake.from_tensor(x.to(device) if device else x) if isinstance(x, torch.Tensor) else x
        ),
        (tuple(args), dict(kwargs)),
    )
    with preserved_state(module), fake:
        units = find_units(module, args, kwargs)
    # The fake mode keeps weak references to the model's tensors; materializing them
    # later swaps their storage, which weak references forbid.
    drop_weak_refs([*module.parameters(), *module.buffers()])
    return units


def renew_tensors(roots: Sequence[nn.Module]) -> dict[int, torch.Tensor]:
    """Give every parameter and buffer in ``roots`` a new Python object over the same
    data, the same new object wherever the old one was; returns old id -> new."""
    new: dict[int, torch.Tensor] = {}
    old: list[torch.Tensor] = []  # alive until the end: ids stay unique
    for root in roots:
        for m in root.modules():
            for store in (m._parameters, m._buffers):
                for key, t in store.items():
                    if t is None:
                        continue
                    if id(t) not in new:
                        old.append(t)
                        new[id(t)] = _twin(t, t.data)
                    store[key] = new[id(t)]  # type: ignore[assignment]
    return new


def tensor_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Every parameter's and buffer's shape, under each of its names."""
    named: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
    named += module.named_buffers(remove_duplicate=False)
    return {name: t.shape for name, t in named}


def drop_weak_refs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Remove ``tensors`` from the weak-keyed caches of fake-tensor modes (``torch.export``
    and FLOPs profiling leave them there); returns those still weakly referenced."""
    watched = [t for t in tensors if weakref.getweakrefcount(t)]
    if not watched:
        return []
    gc.collect()  # caches of modes nothing uses any more go away
    watched = [t for t in watched if weakref.getweakrefcount(t)]
    if watched:
        from torch.utils.weak import WeakIdKeyDictionary

        # type(o), not isinstance: isinstance reads ``__class__``, and objects such as the
        # deprecated torch.distributed.reduce_op warn when any attribute is read
        caches = [o for o in gc.get_objects() if issubclass(type(o), WeakIdKeyDictionary)]
        for cache in caches:
            for t in watched:
                cache.pop(t, None)
    return [t for t in watched if weakref.getweakrefcount(t)]


def _shapes(
    module: nn.Module, by_name: Mapping[str, torch.Size] | None = None
) -> dict[int, torch.Size]:
    """id(tensor) -> shape, from ``by_name`` where it names the tensor."""
    out = {id(t): t.shape for t in [*module.parameters(), *module.buffers()]}
    named: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
    named += module.named_buffers(remove_duplicate=False)
    for name, t in named:
        if by_name is not None and name in by_name:
            out[id(t)] = by_name[name]
    return out


def materialize(module: nn.Module, seed: int = 0, *, init_fn: InitFn | None = None) -> nn.Module:
    """Allocate and initialise, in this process, every tensor of a model built on the
    meta device; returns ``module`` (its parameters stay the same objects unless
    something holds weak references to them, as a live ``torch.export`` does).

    The values equal those :class:`mpar.DistributedModel` gives the same model with
    config ``seed`` in any layout: each tensor is initialised by the model's own
    initialisers (``init_fn(module)`` if given; Hugging Face ``_init_weights``;
    ``reset_parameters()``) under a seed drawn from ``seed`` and its module's name.
    Tensors already on a real device are kept. Raises :class:`mpar.meta.InitError`
    naming a tensor no initialiser set.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"mpar.materialize takes a torch.nn.Module, got {type(module).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if drop_weak_refs([*module.parameters(), *module.buffers()]):
        renew_tensors([module])  # swapping storage needs objects nothing watches
    shapes = _shapes(module)
    run = module_initializer(module, init_fn)
    for group in init_groups(module):
        initialize_group(group, seed=seed, run=run, shapes=shapes)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise InitError(f"mpar.materialize left {left[:5]} on the meta device (no init group)")
    return module


class RankMaterializer:
    """Materializes the tensors of this rank's stage modules of a meta model."""

    def __init__(
        self,
        module: nn.Module,
        stage_modules: Iterable[nn.Module],
        *,
        seed: int,
        device: torch.device,
        init_fn: InitFn | None = None,
        shapes: Mapping[str, torch.Size] | None = None,
        overwritten: Collection[str] = (),
        pieces: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> None:
        self.module = module
        self.pieces = dict(pieces or {})
        """id(tensor) -> this rank's tensor-parallel piece of its initialised whole value
        (a tensor split by TP: it is initialised whole, one init group at a time, and cut)."""
        self.stage_modules = list(stage_modules)
        self.seed = seed
        self.device = torch.device(device)
        self.shapes = _shapes(module, shapes)
        """id(tensor) -> its full shape (``shapes`` by name: before partitioning
        released the tensors of other ranks' stages)."""
        self.groups = init_groups(module)
        self.group_of: dict[int, InitGroup] = {
            id(t): g for g in self.groups for t in g.tensors.values()
        }
        self.needed = {id(t) for m in self.stage_modules for t in [*m.parameters(), *m.buffers()]}
        self.run = module_initializer(module, init_fn)
        named: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
        named += module.named_buffers(remove_duplicate=False)
        over = {id(t) for name, t in named if name in overwritten}
        self.deferred = {
            id(t)
            for g in self.groups
            if all(id(u) in over for u in g.tensors.values())
            for t in g.tensors.values()
        }
        """Tensors of init groups that a pending load overwrites whole: never initialised
        (in a bucket they stay on meta and the bucket leaves zeros for the load)."""

    def ensure(self, tensor: torch.Tensor) -> None:
        """Give ``tensor`` its initialised value (with the rest of its init group), or
        uninitialised storage when a pending load overwrites it."""
        if not tensor.is_meta:
            return
        if id(tensor) in self.deferred:
            shape = self.shapes.get(id(tensor), tensor.shape)
            cut = self.pieces.get(id(tensor))
            if cut is not None:  # a tensor-parallel piece of it
                shape = cut(torch.empty(shape, dtype=tensor.dtype, device="meta")).shape
            empty = torch.empty(shape, dtype=tensor.dtype)
            replace_storage(tensor, _device.to_device(empty, self.device))
            return
        group = self.group_of.get(id(tensor))
        if group is None:
            raise InitError(
                f"a meta tensor of shape {tuple(tensor.shape)} in this rank's stages belongs "
                "to no module of the model; it cannot be initialised"
            )
        fresh = [t for t in group.tensors.values() if t.is_meta and id(t) in self.needed]
        initialize_group(group, seed=self.seed, run=self.run, shapes=self.shapes, keep=self._keep)
        for t in fresh:  # initialised on the host: the same values on every device kind
            cut = self.pieces.get(id(t))
            if cut is not None and not t.is_meta:
                replace_storage(t, cut(t.data).clone())
            if not t.is_meta and t.device != self.device:
                replace_storage(t, _device.to_device(t.data, self.device))

    def ensure_or_defer(self, tensor: torch.Tensor) -> None:
        """What a bucket calls on each parameter before copying it in: :meth:`ensure`,
        except that a parameter a pending load overwrites stays on meta."""
        if id(tensor) not in self.deferred:
            self.ensure(tensor)

    def _keep(self, t: torch.Tensor) -> bool:
        return id(t) in self.needed

    def prepare(self) -> None:
        """Materialize what sharding does not take in buckets: buffers and frozen
        parameters (sharding casts frozen ones under mixed precision)."""
        for m in self.stage_modules:
            for t in [*m.buffers(), *(p for p in m.parameters() if not p.requires_grad)]:
                self.ensure(t)

    def finish(self) -> None:
        """Materialize every tensor of the stages still on the meta device."""
        for m in self.stage_modules:
            for t in [*m.parameters(), *m.buffers()]:
                self.ensure(t)


def hook(materializer: RankMaterializer | None) -> Callable[[torch.Tensor], None] | None:
    """What sharding calls on each parameter before reading it (None: nothing to do)."""
    return None if materializer is None else materializer.ensure_or_defer


def build_module(module: Any) -> nn.Module:
    """``module`` itself, or what a zero-argument factory returns when called under
    ``torch.device("meta")``."""
    if isinstance(module, nn.Module):
        return module
    if not callable(module):
        raise TypeError(
            "mpar.DistributedModel takes a torch.nn.Module or a zero-argument factory "
            f"returning one, got {type(module).__name__}"
        )
    with torch.device("meta"):
        built = module()
    if not isinstance(built, nn.Module):
        raise TypeError(
            f"the factory {getattr(module, '__name__', module)!r} given to "
            f"mpar.DistributedModel returned {type(built).__name__}, not a torch.nn.Module"
        )
    return built


def start_materialize(
    module: nn.Module,
    stages: Any,
    st: Any,
    init_fn: InitFn | None,
    shapes: Mapping[str, torch.Size] | None = None,
    overwritten: Collection[str] = (),
    pieces: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> RankMaterializer | None:
    """For a meta model just split into ``stages`` (a ``LocalStages``): a materializer
    with buffers and frozen parameters done; None for a model with real tensors.
    ``overwritten``: names (state-dict keys) that a load pending for after
    partitioning overwrites whole; their init groups are not initialised."""
    local = list(stages.modules.values())
    if not any(has_meta(m) for m in local):
        return None
    tensors = {id(t): t for m in [module, *local] for t in [*m.parameters(), *m.buffers()]}
    watched = drop_weak_refs(list(tensors.values()))
    if watched:
        raise RuntimeError(
            f"cannot materialize a tensor of shape {tuple(watched[0].shape)}: something holds "
            "a weak reference to it (torch.utils.swap_tensors refuses); please report this"
        )
    materializer = RankMaterializer(
        module,
        local,
        seed=st.config.seed,
        device=st.device,
        init_fn=init_fn,
        shapes=shapes,
        overwritten=overwritten,
        pieces=pieces,
    )
    materializer.prepare()
    return materializer
