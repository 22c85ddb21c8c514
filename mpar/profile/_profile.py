"""Per-unit compute and memory profile of a model.

``profile_model`` runs the model once (no autograd) with forward pre-hooks that
record each unit's inputs, then runs every unit *on its own* on those inputs,
forward and backward, as torchgpipe's ``balance_by_time`` does:

* FLOPs from ``torch.utils.flop_counter.FlopCounterMode`` (forward + backward);
* activation bytes: tensors autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), counted once per storage,
  parameters and buffers excluded;
* output bytes: the tensors the unit returns (what goes to the next unit);
* time: ``mode="measure"``: ``warmup`` runs, then the median of ``repeats``
  forward+backward runs; ``mode="meta"``: ``flops / flops_per_second``.

In ``mode="meta"`` everything runs on fake tensors: nothing is allocated or
computed. The model may live on the meta device (built under
``with torch.device("meta"):``; inputs are moved to meta) or be real (its
tensors are faked where they are): mpar profiles a real model this way when it
does not fit rank 0's ``device_memory``.
Code outside the units (masks, position ids, the loss) is not timed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Literal, TypeGuard, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mpar import _device
from mpar._compat import (
    FakeTensorMode,
    FlopCounterMode,
    as_if_exporting,
    custom_flop_formulas,
    pytree,
)
from mpar.errors import PartitionError
from mpar.profile._units import find_units

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "ModelProfile",
    "UnitProfile",
    "preserved_state",
    "profile_model",
]

Args = tuple[object, ...]
"""Positional arguments of a call (any values)."""
Kwargs = dict[str, object]
"""Keyword arguments of a call (any values)."""
Call = tuple[Args, Kwargs, object]
"""One call of a unit as the model made it: (arguments, keyword arguments, output)."""

#: Bytes of fp32 optimizer state per parameter: Adam keeps two moments, SGD with
#: momentum one buffer.
OPTIMIZER_BYTES_PER_PARAM = {"adam": 8, "sgd": 4, "none": 0}

T = TypeVar("T")


@dataclass
class UnitProfile:
    """Cost of one unit for one microbatch (all calls of the unit summed)."""

    name: str
    param_count: int
    """Parameters owned by this unit (a tied parameter counts for its first unit only)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    flops: int
    """Forward + backward FLOPs."""
    time_s: float
    """Forward + backward seconds (measured median, or estimated from FLOPs)."""
    activation_bytes: int
    """Bytes saved for backward."""
    output_bytes: int
    """Bytes of the tensors the unit returns."""
    tied_state_bytes: dict[str, int] = field(default_factory=dict)
    """Parameters this unit uses that an earlier unit owns: owner → parameter+grad+optimizer bytes."""
    calls: int = 1
    outer_params: list[str] = field(default_factory=list)
    """Parameters outside every unit that run with this unit (counted in its bytes above)."""
    fixed_time_s: float = 0.0
    """Part of ``time_s`` that does not grow with the microbatch size (per-call overhead);
    0 unless fitted from two profiles (``mpar.partition.fit_fixed_times``)."""
    tp_comm_bytes: int = 0
    """Bytes one rank sends over its tensor-parallel group per microbatch (forward and
    backward collectives); 0 except in a TP rank's profile (``mpar.partition._tp_share``)."""
    expert_param_bytes: int = 0
    """Of ``param_bytes``, this rank's experts' under expert parallelism (ZeRO shards them
    over the expert-data-parallel group); 0 except in an ep rank's profile
    (``mpar.partition._ep_share``)."""
    expert_grad_bytes: int = 0
    """Of ``grad_bytes``, this rank's experts' (see ``expert_param_bytes``)."""
    ep_comm_bytes: int = 0
    """Bytes one rank sends in the expert all-to-alls per microbatch (forward and
    backward); 0 except in an ep rank's profile."""
    weight_work_bytes: int = 0
    """Bytes a split backward keeps from the unit's I until its W for one microbatch:
    the input and the output gradient of each linear layer whose weight W computes
    (``runtime._split_backward``; counted for every ``F.linear`` on a trainable
    parameter); the zero-bubble schedules hold them for each microbatch whose W waits."""
    cp_comm_bytes: int = 0
    """Bytes one rank sends for the unit's attention over its context-parallel group per
    microbatch, in the compute dtype (counted at 4 bytes an element); 0 except in a CP
    rank's profile (``mpar.partition._cp_share``)."""
    cp_comm_fp32_bytes: int = 0
    """Of the same traffic, what travels in float32 whatever the precision (the ring's
    dK and dV)."""

    @property
    def state_bytes(self) -> int:
        """Parameter + gradient + optimizer-state bytes."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass
class ModelProfile:
    """Profile of every unit of a model, in execution order."""

    units: list[UnitProfile]
    mode: str
    optimizer: str
    param_count: int
    """Distinct parameters in the whole model."""
    unassigned_param_count: int = 0
    """Parameters that no unit needs: outside every unit and unused by the forward pass."""

    @property
    def names(self) -> list[str]:
        return [u.name for u in self.units]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# ---------------------------------------------------------------------------


def _is_float(t: object) -> TypeGuard[torch.Tensor]:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _tensor_bytes(tree: object) -> int:
    leaves = pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _snapshot(tree: T) -> T:
    """A private copy of one unit call's inputs, taken before the call runs.

    Models pass mutable state between units (a Hugging Face ``DynamicCache`` that
    every attention layer appends to, say). Keeping a reference would hand the
    profiler the state as the *whole* forward left it, and replaying a unit on it
    would mutate it further (and reach into earlier autograd graphs); a deep copy
    taken at call time, copied again for every replay, keeps each replay the same.
    """
    try:
        return copy.deepcopy(tree)
    except Exception:  # an input that cannot be copied is used as it is
        return tree


class _Lineage(TorchFunctionMode):
    """Tracks which of some parameters each tensor computed in the mode derives from."""

    def __init__(self, roots: dict[int, str]) -> None:
        super().__init__()
        self.roots = roots
        self.sources: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # ids stay unique while the mode is in use

    def of(self, tree: object) -> frozenset[str]:
        found: set[str] = set()
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                found |= self.sources.get(id(t), frozenset())
                if id(t) in self.roots:
                    found.add(self.roots[id(t)])
        return frozenset(found)

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Collection[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = self.of((args, kwargs))
        if found:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.sources[id(t)] = found
                    self.alive.append(t)
        return out


def _capture_calls(
    module: nn.Module,
    units: Sequence[str],
    args: Args,
    kwargs: Kwargs,
    roots: dict[int, str] | None = None,
) -> tuple[dict[str, list[Call]], dict[str, str]]:
    """Run the model once without autograd; record (args, kwargs, output) of each unit call.

    Also returns where each of ``roots`` (``id(parameter) -> name``: parameters
    outside every unit, such as a position table on the root module) is first
    needed: the first unit whose inputs derive from it, else the last unit when
    the model's output does (a scale applied after the head); unused ones are absent.
    """
    calls: dict[str, list[Call]] = {u: [] for u in units}
    pending: dict[str, list[tuple[Args, Kwargs]]] = {u: [] for u in units}
    lineage = _Lineage(roots or {})
    consumer: dict[str, str] = {}
    handles = []
    for name in units:

        def pre(_m: nn.Module, a: Args, kw: Kwargs, name: str = name) -> None:
            for root in lineage.of((a, kw)):
                consumer.setdefault(root, name)
            pending[name].append(_snapshot((a, kw)))

        def hook(_m: nn.Module, _a: Args, _kw: Kwargs, out: object, name: str = name) -> None:
            a, kw = pending[name].pop()
            calls[name].append((a, kw, out))

        sub = module.get_submodule(name)
        handles.append(sub.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), lineage:
            out = module(*args, **kwargs)
        for root in lineage.of(out):
            consumer.setdefault(root, units[-1])
    finally:
        for h in handles:
            h.remove()
    return calls, consumer


def _leafify(tree: T) -> tuple[T, list[torch.Tensor]]:
    """Detached copy of the input tree; floating tensors become grad-requiring leaves."""
    leaves: list[torch.Tensor] = []

    def convert(x: object) -> object:
        if _is_float(x):
            y = x.detach().requires_grad_(True)
            leaves.append(y)
            return y
        return x

    converted: T = pytree.tree_map(convert, tree)
    return converted, leaves


def _fwd_bwd(unit: nn.Module, a: Args, kw: Kwargs, params: list[nn.Parameter]) -> object:
    (a, kw), inputs = _leafify(_snapshot((a, kw)))
    out = unit(*a, **kw)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = inputs + params
    if outs and wrt:  # .backward, not autograd.grad: FlopCounterMode's hooks need it
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs], inputs=wrt)
    return out


class _WeightWorkCounter(TorchFunctionMode):
    """Counts, over a unit's forward calls, what a split backward keeps for W: for each
    ``F.linear`` on a trainable parameter (an ``nn.Linear``'s forward, or a direct call,
    which a traced stage defers too), its input (once per storage) and its output's
    size (the output gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs = _SavedCounter(set())
        self.outputs = 0

    @property
    def bytes(self) -> int:
        return self.inputs.bytes + self.outputs

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Collection[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        if func is F.linear and torch.is_grad_enabled():
            kwargs = kwargs or {}
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(weight, nn.Parameter) and weight.requires_grad:
                if isinstance(x, torch.Tensor):  # its whole storage stays alive
                    self.inputs.pack(x)
                if isinstance(out, torch.Tensor):
                    self.outputs += out.numel() * out.element_size()
        return out


class _SavedCounter:
    """Counts bytes autograd saves, once per storage, ignoring parameters and buffers."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
            self.bytes += t.numel() * t.element_size()
            return t
        key = storage._cdata
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t


def _state(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _storage_keys(module: nn.Module) -> set[int]:
    return {t.untyped_storage()._cdata for t in _state(module)}


def _synchronizer(module: nn.Module) -> Callable[[], None]:
    devices = {p.device for p in module.parameters()}
    return lambda: _device.synchronize(devices)


def _time_calls(
    unit: nn.Module, calls: Sequence[Call], params: list[nn.Parameter], repeats: int, warmup: int
) -> float:
    sync = _synchronizer(unit)
    for _ in range(warmup):
        for a, kw, _out in calls:
            _fwd_bwd(unit, a, kw, params)
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for a, kw, _out in calls:
            _fwd_bwd(unit, a, kw, params)
        sync()
        samples.append(time.perf_counter() - start)
    return float(statistics.median(samples))


@dataclass
class _Options:
    optimizer: str
    mode: str
    repeats: int
    warmup: int
    flops_per_second: float


def _profile_unit(
    module: nn.Module,
    name: str,
    calls: Sequence[Call],
    owner_of: dict[int, str],
    exclude: set[int],
    opts: _Options,
) -> UnitProfile:
    """Profile one unit, leaving its parameters' ``.grad`` as they were."""
    unit = module.get_submodule(name)
    saved = [(p, p.grad) for p in unit.parameters()]
    try:
        return _profile_unit_inner(module, name, calls, owner_of, exclude, opts)
    finally:
        for p, grad in saved:
            p.grad = grad


def _profile_unit_inner(
    module: nn.Module,
    name: str,
    calls: Sequence[Call],
    owner_of: dict[int, str],
    exclude: set[int],
    opts: _Options,
) -> UnitProfile:
    unit = module.get_submodule(name)
    params = [p for p in unit.parameters() if p.requires_grad]
    owned = [p for p in unit.parameters() if owner_of[id(p)] == name]
    roots = [(n, p) for n, p in module.named_parameters() if owner_of.get(id(p)) == f"@{name}"]
    owned += [p for _n, p in roots]
    per_param_opt = OPTIMIZER_BYTES_PER_PARAM[opts.optimizer]
    trainable = [p for p in owned if p.requires_grad]
    tied: dict[str, int] = {}
    for p in unit.parameters():
        if owner_of[id(p)] != name:
            state = p.numel() * p.element_size() * (2 if p.requires_grad else 1)
            state += p.numel() * per_param_opt if p.requires_grad else 0
            tied[owner_of[id(p)]] = tied.get(owner_of[id(p)], 0) + state
    counter = _SavedCounter(exclude)
    saved_hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
    weight_work = _WeightWorkCounter()
    flops_of = FlopCounterMode(display=False, custom_mapping=custom_flop_formulas())
    with flops_of as flop_mode, saved_hooks, weight_work:
        for a, kw, _out in calls:
            _fwd_bwd(unit, a, kw, params)
    flops = int(flop_mode.get_total_flops())
    if opts.mode == "meta" or not calls:
        seconds = flops / opts.flops_per_second
    else:
        seconds = _time_calls(unit, calls, params, opts.repeats, opts.warmup)
    return UnitProfile(
        name=name,
        param_count=sum(p.numel() for p in owned),
        param_bytes=sum(p.numel() * p.element_size() for p in owned),
        grad_bytes=sum(p.numel() * p.element_size() for p in trainable),
        optimizer_bytes=sum(p.numel() for p in trainable) * per_param_opt,
        flops=flops,
        time_s=seconds,
        activation_bytes=counter.bytes,
        output_bytes=sum(_tensor_bytes(out) for _a, _kw, out in calls),
        tied_state_bytes=tied,
        calls=len(calls),
        weight_work_bytes=weight_work.bytes,
        outer_params=[n for n, _p in roots],
    )


def _profile_units(
    module: nn.Module,
    names: Sequence[str],
    calls: Mapping[str, Sequence[Call]],
    owner_of: dict[int, str],
    exclude: set[int],
    opts: _Options,
) -> list[UnitProfile]:
    """Every unit's profile. In meta mode a unit identical to one already profiled
    (``_unit_key``: same modules, settings, parameters and calls, e.g. the 80 decoder
    blocks of a 70B model) takes that one's figures (FLOPs, bytes and the time derived
    from them are functions of exactly these) instead of being traced again."""
    seen: dict[Hashable, UnitProfile] = {}
    profiles = []
    for name in names:
        key = (
            _unit_key(module, name, calls[name], owner_of, exclude) if opts.mode == "meta" else None
        )
        if key is not None and key in seen:
            profiles.append(dataclasses.replace(seen[key], name=name))
            continue
        profiles.append(_profile_unit(module, name, calls[name], owner_of, exclude, opts))
        if key is not None:
            seen[key] = profiles[-1]
    return profiles


_SCALARS = (int, float, str, bool, type(None), torch.dtype, torch.device)


def _unit_key(
    module: nn.Module,
    name: str,
    calls: Sequence[Call],
    owner_of: dict[int, str],
    exclude: set[int],
) -> Hashable | None:
    """What a unit's meta profile depends on, or None where that cannot be told.

    Its modules (class, and every scalar setting, but an index: ``layer_idx``), its
    parameters and buffers (shape, dtype, trainable, and which unit owns each), and
    each call's arguments (tensors by shape, dtype, strides, whether they need a
    gradient or alias the model's state; scalars by value) and output bytes. A call
    argument of any other kind, or parameters held for this unit from outside it,
    makes the unit its own (None)."""
    unit = module.get_submodule(name)
    if any(owner == "@" + name for owner in owner_of.values()):
        return None
    parts: list[Hashable] = []
    for sub_name, sub in unit.named_modules():
        settings = tuple(
            (k, v)
            for k, v in sorted(vars(sub).items())
            if isinstance(v, _SCALARS) and "idx" not in k and "index" not in k
        )
        parts.append((sub_name, type(sub).__module__, type(sub).__qualname__, settings))
    for n, p in unit.named_parameters():
        owner = "self" if owner_of[id(p)] == name else owner_of[id(p)]
        parts.append((n, tuple(p.shape), p.dtype, p.requires_grad, owner))
    parts += [(n, tuple(b.shape), b.dtype) for n, b in unit.named_buffers()]
    for a, kw, out in calls:
        leaves, spec = pytree.tree_flatten((a, kw))
        described = [_leaf_key(x, exclude) for x in leaves]
        if any(d is None for d in described):
            return None
        parts.append((str(spec), tuple(described), _tensor_bytes(out)))
    return tuple(parts)


def _leaf_key(x: object, exclude: set[int]) -> Hashable | None:
    if isinstance(x, torch.Tensor):
        aliased = x.untyped_storage()._cdata in exclude
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.requires_grad, aliased)
    return ("value", x) if isinstance(x, _SCALARS) else None


def _owners(module: nn.Module, units: Sequence[str]) -> dict[int, str]:
    """id(param) → the first unit (in execution order) that holds it."""
    owner: dict[int, str] = {}
    for name in units:
        for p in module.get_submodule(name).parameters():
            owner.setdefault(id(p), name)
    return owner


def profile_mode(module: nn.Module, device_memory: int | str | None) -> Literal["measure", "meta"]:
    """How to profile ``module`` on one rank without running what does not fit there:
    ``"meta"`` (FLOPs on fake tensors: nothing is allocated or run) for a model on the
    meta device, or for one whose weights and gradients exceed ``device_memory`` (a
    rank's budget, bytes or ``"16GiB"``; None or 0: no budget); else ``"measure"``."""
    from mpar._size import parse_bytes

    tensors = _state(module)
    if any(t.is_meta for t in tensors):
        return "meta"
    if not device_memory:
        return "measure"
    need = sum(t.numel() * t.element_size() for t in tensors)
    need += sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return "meta" if need > parse_bytes(device_memory) else "measure"


def _to_meta(tree: T) -> T:
    meta: T = pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)
    return meta


def _check_options(module: nn.Module, optimizer: str, mode: str, repeats: int) -> None:
    if optimizer not in OPTIMIZER_BYTES_PER_PARAM:
        raise ValueError(f"optimizer must be one of adam, sgd, none; got {optimizer!r}")
    if mode not in ("measure", "meta"):
        raise ValueError(f"mode must be 'measure' or 'meta', got {mode!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    real = [n for n, p in module.named_parameters() if not p.is_meta]
    if mode == "measure" and len(real) < len(list(module.parameters())):
        raise PartitionError(
            "the model has parameters on the meta device; profile it with mode='meta'"
        )


@contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Run a block that calls ``module`` without leaving a trace of it.

    Profiling and splitting run the model on example inputs; they must not
    change what training then computes: buffers that forward updates (batch-norm
    running statistics, counters) get their values back, and the random number
    generators (dropout) their states.
    """
    saved = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    with torch.random.fork_rng():
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    if buffer.shape == value.shape:
                        buffer.copy_(value)


def profile_model(
    module: nn.Module,
    example_args: Sequence[object],
    example_kwargs: Mapping[str, object] | None = None,
    *,
    units: Sequence[str] | None = None,
    optimizer: Literal["adam", "sgd", "none"] = "adam",
    mode: Literal["measure", "meta"] = "measure",
    repeats: int = 3,
    warmup: int = 1,
    flops_per_second: float = 1e14,
) -> ModelProfile:
    """Profile every unit of ``module`` on one microbatch of example inputs.

    Args:
        module: the model (on the meta device for ``mode="meta"``).
        example_args, example_kwargs: one microbatch of inputs.
        units: unit names in execution order; default ``find_units(module, ...)``.
        optimizer: optimizer-state bytes per trainable parameter: adam 8, sgd (momentum) 4, none 0.
        mode: ``"measure"`` times real runs; ``"meta"`` estimates time from FLOPs.
        repeats, warmup: timed and untimed runs per unit (measure mode).
        flops_per_second: the assumed device speed in meta mode (only ratios matter
            for partitioning; absolute predicted times scale with it).
    """
    _check_options(module, optimizer, mode, repeats)
    args: Args = tuple(example_args)
    kwargs: Kwargs = dict(example_kwargs or {})
    fake = FakeTensorMode(allow_non_fake_inputs=True) if mode == "meta" else None
    if fake is not None:
        # Fake tensors: models that check values where they can (Hugging Face masks:
        # "is this mask all ones?") skip the check when tracing. Inputs go where the
        # model is: meta for a meta model; a real model's tensors are faked in place.
        on_meta = any(t.is_meta for t in _state(module))
        args, kwargs = pytree.tree_map(
            lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x,
            _to_meta((args, kwargs)) if on_meta else (args, kwargs),
        )
    context = fake if fake is not None else contextlib.nullcontext()
    with preserved_state(module), context, as_if_exporting(fake is not None):
        # The fake copies of parameters that ops make, kept alive so every op gets the same.
        fakes = [fake.from_tensor(t) for t in _state(module)] if fake is not None else []
        names = list(units) if units is not None else find_units(module, args, kwargs)
        owner_of = _owners(module, names)
        outer = {id(p): n for n, p in module.named_parameters() if id(p) not in owner_of}
        calls, consumer = _capture_calls(module, names, args, kwargs, outer)
        for key, n in outer.items():  # "@unit": held with that unit, not inside it
            # an unused one stays with the last unit, where the runtime keeps it
            owner_of[key] = "@" + consumer.get(n, names[-1])
        exclude = _storage_keys(module) | {t.untyped_storage()._cdata for t in fakes}
        opts = _Options(optimizer, mode, repeats, warmup, flops_per_second)
        profiles = _profile_units(module, names, calls, owner_of, exclude, opts)
    distinct = {id(p): p.numel() for p in module.parameters()}
    unassigned = sum(n for key, n in distinct.items() if key not in owner_of)
    return ModelProfile(profiles, mode, optimizer, sum(distinct.values()), unassigned)
