"""The backward of one stage split in two: input gradients now (I), weights later (W).

Zero-bubble schedules run the part of a stage's backward that the previous
stage waits for (I) as early as possible and the rest (W) where the rank
would otherwise idle. mpar defers the weight gradients of linear layers, where
nearly all of a transformer's weight-gradient work is (the approach of the
zero-bubble paper's implementation, which stores the pieces of each linear
layer's weight gradient and computes them later):

* :func:`defer_weight_gradients` routes every ``nn.Linear`` of a stage (and,
  in a traced stage, every ``aten.linear`` call of its graph on parameters)
  through :func:`deferred_linear`: ``F.linear`` on a detached alias of the
  weight, so autograd's own (C++) node computes the input and bias gradients
  and never the weight's, plus a pre-hook on that node which receives the
  output gradient ``dy``: inside I it keeps ``(weight, x, dy)``; outside I (a
  whole B, an unsplit schedule) it adds ``dy^T x`` to the weight's gradient at
  once. Under saved-tensor hooks other than mpar's activation counting
  (activation checkpointing, offloading) the layer's input must be saved
  through the hooks, so there :class:`_DeferredLinear` (a Python autograd
  function, the former way, which also defers the bias) does the same.
* :func:`split_backward` runs I: one ordinary backward from the stage's
  outputs (or its loss) with the linear layers deferring. The stage's input
  gradients, and every other parameter's gradient (embeddings, norms, biases;
  a weight shared with an embedding gets the embedding's share), come out of
  it; the autograd graph is freed as usual. It returns W, which computes the
  kept linear layers' gradients (``dy^T x``, and ``sum(dy)`` for the former
  way's biases, in the layer's dtype) and accumulates them into ``.grad`` as
  autograd would: in place when a gradient exists (a flat ZeRO bucket's view,
  or a previous microbatch's; ``addmm_`` writes into it directly), else as a
  new tensor.

Together the two parts do the work of one ordinary backward, plus a node
pre-hook per linear layer (a few microseconds each on the CPU, registered in
the forward and called in I; the Python autograd function cost about 20). A
layer whose input is modified in place after the layer used it is an error at
I, as autograd's own version check makes it. A stage whose inputs need no
gradient (the first stage: token ids) has no I to compute, so W runs its whole
backward; the executor does not defer the first stage's layers at all (nothing
waits for its I), so that W is an ordinary backward. Activation checkpointing
composes: the forward recomputed inside I goes through the same linear layers.
The config key ``split_backward: false`` (or ``MPAR_SPLIT_BACKWARD=0`` at init)
runs the whole backward in I (W empty): an escape hatch, same gradients.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpar._compat import top_saved_tensors_hooks
from mpar._tree import tree_leaves
from mpar.comm import _process_state
from mpar.runtime._activations import counting_only

__all__ = [
    "Defer",
    "WeightWork",
    "accumulate_weight_grads",
    "defer_weight_gradients",
    "deferred_linear",
    "split_backward",
]


_Kept = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor]
_KEEPING: list[list[_Kept]] = []
"""The list the current I adds its linear layers' (weight, bias, input, output gradient)
to; empty outside I. A plain module-level stack, not thread-local: the autograd engine
may run a backward on a device thread of its own."""
_process_state.register(
    "mpar.runtime._split_backward._KEEPING", _KEEPING.clear, lambda: not _KEEPING
)


_DEFERRING: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
"""Modules :func:`defer_weight_gradients` has gone through, and how many layers defer.
Not reset by ``mpar.shutdown`` (listed in :mod:`mpar.comm._process_state` as kept): it
records what was done to the modules themselves (their linear layers stay patched),
which outlive an ``init``."""


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose weight and bias gradients wait for W while an I is running."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        # The parameters themselves, not saved tensors: what a saved-tensor hook
        # unpacks may be another tensor object, whose .grad W would fill in vain.
        ctx.weight, ctx.bias = weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        wants_w, wants_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if _KEEPING and (wants_w or wants_b):
            _KEEPING[-1].append((weight, bias if wants_b else None, x, dy))
            return dx, None, None
        dw, db = _weight_grads(x, dy, wants_w, wants_b)
        return dx, dw, db


def _weight_grads(
    x: torch.Tensor, dy: torch.Tensor, wants_w: bool, wants_b: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])) if wants_w else None
    db = dy2.sum(0) if wants_b else None
    return dw, db


Defer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool]
"""Where a weight gradient may wait outside an I: called with ``(weight, x, dy)`` when
the output gradient arrives, returns whether it kept them (then it computes the
gradient later, with :func:`accumulate_weight_grads`)."""


def deferred_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    defer: Defer | None = None,
) -> torch.Tensor:
    """``F.linear`` that defers its weight gradient to W when the weight is a parameter
    (a leaf that requires grad; a weight computed from others keeps its usual backward).

    The usual way is ``F.linear`` on a detached alias of the weight, so autograd's own
    node computes the input and bias gradients and never the weight's, and a hook on
    the output's gradient node keeps ``(weight, x, dy)`` for W (or, outside an I,
    offers them to ``defer``, else accumulates ``dy^T x`` at once). Under saved-tensor
    hooks other than mpar's activation counting (activation checkpointing, offloading)
    the layer's input must go through the hooks, so :class:`_DeferredLinear` saves it
    instead (or, with ``defer``, which only outside an I matters to, the layer is a
    plain ``F.linear``).
    """
    if not (
        weight.requires_grad
        and weight.is_leaf
        and (bias is None or bias.is_leaf)
        and torch.is_grad_enabled()
    ):
        return F.linear(x, weight, bias)
    hooks = top_saved_tensors_hooks()
    if (hooks is not None and not counting_only(hooks[0])) or not (
        x.requires_grad or (bias is not None and bias.requires_grad)
    ):  # (an output that needs no gradient but the weight's has no node to hook)
        if defer is not None:
            return F.linear(x, weight, bias)
        return _DeferredLinear.apply(x, weight, bias)
    y = F.linear(x, weight.detach(), bias)
    if hooks is not None:
        hooks[0](x)  # counted as autograd's own saves are: W keeps it
    # the node that made the output (for a batched input, of the matrix y is a view
    # of): its gradient is the output's as the layer returned it, even when y is
    # modified in place later (which gives y a new node)
    made = y if y._base is None else y._base
    node = made.grad_fn
    if node is None:  # cannot be: x or bias requires grad
        raise RuntimeError("internal: a linear layer's output has no gradient node")
    node.register_prehook(functools.partial(_keep, weight, x, x._version, made.output_nr, defer))
    return y


def _keep(
    weight: torch.Tensor,
    x: torch.Tensor,
    version: int,
    index: int,
    defer: Defer | None,
    grads: tuple[torch.Tensor | None, ...],
) -> None:
    """The output gradient of a linear layer arrived (its node's pre-hook): keep it
    for W inside an I, else offer it to ``defer``, else accumulate the weight's
    gradient now."""
    dy = grads[index]
    if dy is None:
        return
    if x._version != version:
        raise RuntimeError(
            "a linear layer's input was modified by an in-place operation after the "
            "layer used it; its weight gradient needs the original values: make the "
            "operation out of place (or clone the input)"
        )
    if _KEEPING:
        _KEEPING[-1].append((weight, None, x, dy))
    elif defer is None or not defer(weight, x, dy):
        accumulate_weight_grads([(weight, None, x, dy)])


def _deferred_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return deferred_linear(x, self.weight, self.bias)


def defer_weight_gradients(module: nn.Module) -> int:
    """Route every ``nn.Linear`` of ``module`` (its own forward, not a subclass's)
    through :class:`_DeferredLinear`, and in a traced stage (whose graph calls
    ``aten.linear`` on the parameters) every such call; idempotent. Returns how many
    layers (calls) defer."""
    if module in _DEFERRING:
        return _DEFERRING[module]
    count = 0
    for traced in module.modules():
        replace = getattr(traced, "replace_calls", None)  # mpar.partition's TracedStage
        if replace is not None:
            count += replace(torch.ops.aten.linear.default, deferred_linear)
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward:
            if "forward" not in vars(layer):
                layer.forward = types.MethodType(_deferred_forward, layer)  # type: ignore[method-assign]
            count += 1
    _DEFERRING[module] = count
    return count


class WeightWork:
    """W of one stage and microbatch, as I (:func:`split_backward`) leaves it: calling it
    computes the weight gradients. Until then it holds memory, which the executor
    counts among the step's activations (:meth:`held_tensors`)."""

    __slots__ = ("kept", "whole")

    def __init__(self, kept: list[_Kept] | None, whole: Callable[[], None] | None) -> None:
        self.kept = kept
        """The linear layers' ``(weight, bias, x, dy)`` W computes from."""
        self.whole = whole
        """The whole backward, not yet run (a stage whose inputs need no gradient): its
        autograd graph, with everything its forward saved, is held until W."""

    def __call__(self) -> None:
        if self.whole is not None:
            whole, self.whole = self.whole, None
            whole()
        if self.kept:
            accumulate_weight_grads(self.kept)

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors only this W keeps alive once I is done: each kept layer's input
        and output gradient (empty for a whole backward, whose graph holds what the
        forward saved)."""
        return [t for _w, _b, x, dy in self.kept or () for t in (x, dy)]


def split_backward(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor] | None,
    inputs: object,
    *,
    split: bool = True,
) -> WeightWork:
    """Run I: the stage's input gradients (and every gradient that is not a deferring
    linear layer's); return W. ``split=False`` (config ``split_backward``) runs the
    whole backward here and returns an empty W."""
    leaves = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]

    def whole() -> None:
        torch.autograd.backward(roots, root_grads)

    if not leaves:  # nothing upstream waits: all of the backward is weight work
        return WeightWork(None, whole)
    if not split:
        whole()
        return WeightWork(None, None)
    kept: list[_Kept] = []
    _KEEPING.append(kept)
    try:
        whole()
    finally:
        _KEEPING.pop()
    return WeightWork(kept, None)


@torch.no_grad()
def accumulate_weight_grads(kept: list[_Kept]) -> None:
    """W: the kept ``(weight, bias, x, dy)`` linear layers' gradients (the list is
    emptied), accumulated as autograd accumulates (into an existing ``.grad`` in
    place, with the matmul writing into it directly). A new gradient is ``dy^T x``
    computed as autograd's matrix-product backward computes it: the same values."""
    while kept:
        weight, bias, x, dy = kept.pop()
        dy2 = dy.reshape(-1, dy.shape[-1])
        if weight.requires_grad:
            x2 = x.reshape(-1, x.shape[-1])
            if x2.dtype != dy2.dtype:
                x2 = x2.to(dy2.dtype)
            grad = weight.grad
            if grad is None:
                dw = dy2.t().mm(x2)
                weight.grad = dw if dw.dtype == weight.dtype else dw.to(weight.dtype)
            elif grad.dtype == dy2.dtype:
                grad.addmm_(dy2.t(), x2)
            else:
                grad.add_(dy2.t().mm(x2))
        if bias is not None:
            if bias.grad is None:
                bias.grad = dy2.sum(0)
            else:
                bias.grad.add_(dy2.sum(0))
