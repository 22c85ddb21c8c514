"""Measuring what a tensor-parallel plan splits in each unit (one forward, hooks only).

``measure_splits`` runs the whole model once with autograd on (on fake tensors when
the model is on the meta device or was profiled in meta mode, as ``mpar.profile``
does) and records, per unit:

* its own parameters that are split (``shards``: the names of ``plan_layout``'s
  ``layout.shards``; ownership as the profile counts it: the first unit in execution
  order that holds a parameter, or the unit a parameter outside every unit goes with)
  and the split parameters it shares with an earlier unit;
* the activations autograd saves inside a split region (after a colwise module's
  forward up to the end of the next rowwise module's, including the rowwise module's
  own input) and outside one, once per storage, parameters and buffers excluded;
* the tensors the plan's modules communicate: a colwise module's input (its gradient
  is all-reduced in the backward), a rowwise module's output (all-reduced in the
  forward), an all-gathered output (``colwise_rep``) or input gradient
  (``rowwise_rep``), an ``embedding_rowwise`` output (all-reduced).

It takes the split modules' styles and the split parameters' names, not the layout
object: the planner sits below ``mpar.tensor_parallel`` (which imports the
communication package), so the caller builds the layout and hands its contents here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpar._compat import FakeTensorMode, pytree
from mpar.partition._tp_share import UnitSplit
from mpar.profile import OPTIMIZER_BYTES_PER_PARAM, preserved_state

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from mpar._tp_styles import Style
    from mpar.profile import UnitProfile

__all__ = ["measure_splits", "param_splits"]


def _nbytes(tree: object) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    )


@dataclass
class _Tally:
    """Bytes seen for one unit during the forward."""

    split: int = 0
    whole: int = 0
    allreduce: int = 0
    gather: int = 0
    seen: set[int] = field(default_factory=set)


class _Recorder:
    """Hooks: which unit runs, whether a split region is open, what autograd saves."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.unit: str | None = None
        self.in_split = False
        self.tallies: dict[str, _Tally] = {}
        self.alive: list[torch.Tensor] = []

    def tally(self) -> _Tally | None:
        return None if self.unit is None else self.tallies.setdefault(self.unit, _Tally())

    def pack(self, t: torch.Tensor) -> None:
        """Count ``t``; keep it alive here (its storage must not be reused and counted
        again during the forward) and give autograd nothing: a graph holding the tensor
        it saved would hold itself (tensor -> its node -> the tensor), outlive the
        forward until Python's cycle collector runs, and keep every parameter's gradient
        accumulator with the whole shapes that the TP layout changes afterwards (the
        stages' backward then fails: "TBackward0 returned an invalid gradient")."""
        self.alive.append(t)
        tally = self.tally()
        if tally is None:
            return
        try:
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            key, nbytes = id(t), t.numel() * t.element_size()
        if key in self.exclude or key in tally.seen:
            return
        tally.seen.add(key)
        if self.in_split:
            tally.split += nbytes
        else:
            tally.whole += nbytes

    @staticmethod
    def unpack(_packed: None) -> torch.Tensor:
        raise RuntimeError("internal: measure_splits' forward is not for backward")

    def enter_unit(self, name: str) -> None:
        self.unit, self.in_split = name, False

    def leave_unit(self) -> None:
        self.unit, self.in_split = None, False

    def before(self, module: nn.Module, style: Style, inputs: tuple[object, ...]) -> None:
        tally = self.tally()
        if style.kind == "rowwise":
            self.in_split = True  # the rowwise module saves its local input piece
            if style.split_input and tally is not None:
                tally.gather += _nbytes(inputs)  # its input's gradient is all-gathered
        elif style.kind == "colwise" and not isinstance(module, nn.Embedding) and tally is not None:
            tally.allreduce += _nbytes(inputs)  # tp_copy: the gradient is all-reduced

    def after(self, style: Style, output: object) -> None:
        tally = self.tally()
        nbytes = _nbytes(output)
        if style.kind in ("rowwise", "embedding_rowwise"):
            self.in_split = False
            if tally is not None:
                tally.allreduce += nbytes
        elif style.kind == "colwise":
            self.in_split = not style.gather_output
            if style.gather_output and tally is not None:
                tally.gather += nbytes


def _hooks(
    module: nn.Module, units: Sequence[str], styles: Mapping[str, Style], rec: _Recorder
) -> list[RemovableHandle]:
    handles = []
    for name in units:
        sub = module.get_submodule(name)
        handles.append(sub.register_forward_pre_hook(lambda *_a, n=name: rec.enter_unit(n)))
        handles.append(sub.register_forward_hook(lambda *_a: rec.leave_unit()))
    for name, style in styles.items():
        sub = module.get_submodule(name)

        def pre(mod: nn.Module, inputs: tuple[object, ...], style: Style = style) -> None:
            rec.before(mod, style, inputs)

        def post(
            _mod: nn.Module, _inputs: tuple[object, ...], out: object, style: Style = style
        ) -> None:
            rec.after(style, out)

        handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    return handles


def _state_bytes(p: torch.Tensor, per_param: int) -> int:
    nbytes = p.numel() * p.element_size()
    return 2 * nbytes + p.numel() * per_param if p.requires_grad else nbytes


def param_splits(
    module: nn.Module, units: Sequence[UnitProfile], shards: Collection[str], optimizer: str
) -> dict[str, UnitSplit]:
    """Per unit: its own split parameters and the split ones it shares with an earlier unit
    (nothing runs: parameters only; no activations nor communication)."""
    split = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if n in shards}
    by_name = dict(module.named_parameters())
    owner: dict[int, str] = {}
    for u in units:
        for p in module.get_submodule(u.name).parameters():
            owner.setdefault(id(p), u.name)
        for n in u.outer_params:
            owner.setdefault(id(by_name[n]), u.name)
    per_param = OPTIMIZER_BYTES_PER_PARAM.get(optimizer, 8)
    out = {}
    for u in units:
        own = [p for p in by_name.values() if owner.get(id(p)) == u.name and id(p) in split]
        tied: dict[str, int] = {}
        for p in module.get_submodule(u.name).parameters():
            if id(p) in split and owner[id(p)] != u.name:
                tied[owner[id(p)]] = tied.get(owner[id(p)], 0) + _state_bytes(p, per_param)
        out[u.name] = UnitSplit(
            param_count=sum(p.numel() for p in own),
            param_bytes=sum(p.numel() * p.element_size() for p in own),
            grad_bytes=sum(p.numel() * p.element_size() for p in own if p.requires_grad),
            tied_state_bytes=tied,
        )
    return out


@contextmanager
def _running(
    module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], fake_run: bool
) -> Iterator[tuple[tuple[object, ...], dict[str, object], set[int]]]:
    """The inputs to run with (fake ones for a meta model, or with ``fake_run``: meta
    ones for a meta model, a real one's faked in place) and storages to exclude."""
    state = [*module.parameters(), *module.buffers()]
    meta = any(t.is_meta for t in state)
    faking = meta or fake_run
    fake = FakeTensorMode(allow_non_fake_inputs=True) if faking else None
    if fake is not None:
        args, kwargs = pytree.tree_map(
            lambda x: (
                fake.from_tensor(x.to("meta") if meta else x) if isinstance(x, torch.Tensor) else x
            ),
            (args, kwargs),
        )
    with preserved_state(module), fake if fake is not None else contextlib.nullcontext():
        fakes = [fake.from_tensor(t) for t in state] if fake is not None else []
        exclude = {t.untyped_storage()._cdata for t in [*state, *fakes]}
        yield args, kwargs, exclude


def measure_splits(
    module: nn.Module,
    units: Sequence[UnitProfile],
    styles: Mapping[str, Style],
    shards: Collection[str],
    args: Sequence[object],
    kwargs: Mapping[str, object] | None = None,
    *,
    optimizer: str = "adam",
    fake: bool = False,
) -> dict[str, UnitSplit]:
    """Per unit of a profile: what the plan (``styles`` of split modules, names of split
    parameters) splits, at the example inputs' microbatch (see the module docs).

    ``fake``: run on fake tensors even for a real model (a meta-mode profile's model).
    Nothing of the forward outlives the call (see ``_Recorder.pack``)."""
    params = param_splits(module, units, shards, optimizer)
    names = [u.name for u in units]
    with _running(module, tuple(args), dict(kwargs or {}), fake) as (a, kw, exclude):
        rec = _Recorder(exclude)
        handles = _hooks(module, names, styles, rec)
        hooks = torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack)
        try:
            with torch.enable_grad(), hooks:
                module(*a, **kw)
        finally:
            for h in handles:
                h.remove()
            rec.alive.clear()  # the forward's graph goes with its saved tensors, now
    out = {}
    for name, split in params.items():
        t = rec.tallies.get(name, _Tally())
        saved = t.split + t.whole
        out[name] = UnitSplit(
            split.param_count,
            split.param_bytes,
            split.grad_bytes,
            split.tied_state_bytes,
            t.split / saved if saved else 0.0,
            t.allreduce,
            t.gather,
        )
    return out
