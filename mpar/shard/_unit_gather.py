"""Unit-granular ZeRO-3 gathering and per-unit gradient reduction inside a stage.

A stage's parameters are split into *groups* of partition units (by default
one unit each: a transformer block, the embedding, the head). Each group has
buckets of its own (:class:`~mpar.shard._bucket.FlatBucket` with
``ReduceOptions.per_unit``); parameters that no single group owns (tied weights, a
position table on the root module, anything used outside its unit) stay in
*stage-wide* buckets, gathered for the stage as a whole.

The stage calls four hooks per group (placed by the runtime: module hooks on
the unit submodules, or gates inserted into a traced stage's graph):

* ``pre_forward(g)``: gather group ``g`` (waiting for a prefetch if one is in
  flight) and start gathering ``g + 1``;
* ``post_forward(g)``: free ``g`` (``reshard_after_forward``);
* ``pre_backward(g)``: gather ``g`` again, start ``g - 1`` (a group whose backward
  reads none of its parameters, an embedding lookup, is neither gathered nor
  prefetched for it: its parameters get their shapes without memory);
* ``post_backward(g)``: free ``g``, then (ZeRO 2 and 3) flatten the gradients
  autograd gave its parameters into one buffer and start its reduce-scatter.

At ZeRO-3 a linear layer whose weight nothing else reads (in a traced stage,
``mpar.partition._gates.linear``) runs through :meth:`UnitGather.linear`: when
the layer's input and output gradient are no larger than the weight, the gate
keeps them and computes ``dy^T x`` at ``post_backward``, after the group's
parameters are freed (with the runtime's split-backward functions,
:class:`WeightGradHooks`; they
get their shapes, without memory, to take the gradient). The matrix product's
backward then computes only the input gradient, and the gathered weight and
its gradient never exist at once: for an LM head, the vocabulary's table once
instead of twice. The values are those autograd computes.

The reasons a group is gathered are counted (*holds*: forward, backward,
prefetch), so activation checkpointing, which reruns a stage's forward inside
its backward, never frees a group that the backward still reads. After each
forward and backward of the stage the runtime calls :meth:`UnitGather.after_forward`
/ :meth:`UnitGather.after_backward`, which drop what the hooks left (a prefetch
no forward used, a group whose inputs took no gradient, so its
``post_backward`` never ran) and start the reductions of groups whose
parameters did not all get a gradient.

Peak parameter memory of a stage at ZeRO-3 is then its shard, its stage-wide
buckets, and at most two groups gathered (the current one and the prefetched
one; three under activation checkpointing, whose recomputed forward runs
inside a group's backward); peak gradient memory is the reduced shards plus one group's full-size
gradients (briefly also their flat copy, after the group's parameters were
freed), as with FSDP2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mpar import _device
from mpar.shard._bucket import FlatBucket

__all__ = ["UnitGather", "UnitGroup", "WeightGradHooks"]

_FORWARD, _BACKWARD, _PREFETCH, _SHAPES = "forward", "backward", "prefetch", "shapes"
_LINEAR = torch.ops.aten.linear.default

Kept = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor]
"""``(weight, bias, x, dy)`` of a linear layer whose weight gradient waits."""


@dataclass(frozen=True)
class WeightGradHooks:
    """How a linear layer's weight gradient waits: the runtime's split backward
    (``mpar.runtime._split_backward``), handed down by the runtime."""

    linear: Callable[..., torch.Tensor]
    """``deferred_linear(x, weight, bias, *, defer)``: ``F.linear`` whose weight
    gradient goes to ``defer(weight, x, dy)`` (which returns whether it kept it)."""
    accumulate: Callable[[list[Kept]], None]
    """``accumulate_weight_grads(kept)``: the kept gradients, as autograd computes
    and accumulates them."""


@dataclass
class UnitGroup:
    """One group of units of one stage and the buckets holding their parameters."""

    stage: int
    index: int
    buckets: list[FlatBucket]
    holds: set[str] = field(default_factory=set)
    unread_in_backward: bool = False
    """The group's backward reads none of its parameters (an embedding lookup):
    ZeRO-3 gives them their shapes for it, not their values
    (:meth:`~mpar.shard._bucket.FlatBucket.acquire_shapes`)."""
    kept: list[Kept] = field(default_factory=list)
    """``(weight, None, x, dy)`` of linear layers whose weight gradient waits for the
    group's parameters to be freed (:meth:`UnitGather.linear`)."""

    @property
    def key(self) -> tuple[str, int, int]:
        """What the buckets record as their user while this group holds them."""
        return ("unit", self.stage, self.index)


class UnitGather:
    """The per-group hooks of one stage (see the module docstring)."""

    def __init__(
        self,
        stage: int,
        groups: Sequence[list[FlatBucket]],
        *,
        gather: bool,
        reshard_after_forward: bool,
        prefetch: int = 1,
        on_gather: object = None,
        on_grads: Callable[[Sequence[FlatBucket]], None] | None = None,
        unread_in_backward: Sequence[bool] = (),
        weight_grads: WeightGradHooks | None = None,
    ) -> None:
        self.stage = stage
        self.groups = [UnitGroup(stage, g, list(b)) for g, b in enumerate(groups)]
        for group, unread in zip(self.groups, unread_in_backward):
            group.unread_in_backward = unread and bool(group.buckets)
        self.gather = gather
        """ZeRO-3: gather and free the groups' parameters (else only reduce per group)."""
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        """Groups gathered ahead of the one computing (``zero.prefetch``)."""
        self.on_gather = on_gather
        """Called with no argument after each gather starts (peak accounting)."""
        self.on_grads = on_grads
        """Called with the buckets whose gradient buffers changed (a group's, before and
        after its gradients are flattened; those whose reduction finished)."""
        self.weight_grads = weight_grads
        """Makes linear layers' weight gradients wait for :meth:`post_backward` (None:
        they never wait)."""
        self.reducing: list[UnitGroup] = []
        """Groups whose gradients were bound in a backward, oldest first: their
        reductions are in flight or about to start."""

    # ------------------------------------------------------------------ holds
    def _hold(self, group: UnitGroup, reason: str, *, wait: bool) -> None:
        first = not group.holds - {_SHAPES}  # (shapes alone: nothing gathered)
        group.holds.add(reason)
        if not self.gather:
            return
        if first:
            for bucket in group.buckets:
                bucket.acquire(group.key, wait=False)
            if callable(self.on_gather):
                self.on_gather()
        if wait:
            for bucket in group.buckets:
                bucket.wait_gathered()

    def _drop(self, group: UnitGroup, *reasons: str) -> None:
        group.holds.difference_update(reasons)
        if self.gather and not group.holds:
            for bucket in group.buckets:
                bucket.release(group.key)

    def _prefetch(self, g: int, step: int) -> None:
        """Start gathering the nearest ``prefetch`` groups from ``g`` on (``step`` +1 or
        -1) that have parameters: groups without any (an activation function) are
        skipped, and so, in a backward (``step`` -1), are groups whose backward reads
        none. A gather only starts here; the compute stream waits for it in the hook
        of the group that reads it (``pre_forward`` / ``pre_backward``)."""
        budget = self.prefetch
        while self.gather and budget > 0 and 0 <= g < len(self.groups):
            group = self.groups[g]
            if group.buckets and not (step < 0 and group.unread_in_backward):
                if not group.holds:
                    self._hold(group, _PREFETCH, wait=False)
                budget -= 1
            g += step

    # ------------------------------------------------------------------ hooks
    def pre_forward(self, g: int) -> None:
        group = self.groups[g]
        self._hold(group, _FORWARD, wait=True)
        group.holds.discard(_PREFETCH)
        if not any(_BACKWARD in other.holds for other in self.groups):
            self._prefetch(g + 1, 1)
        # else: a forward recomputed inside a backward (activation checkpointing): the
        # group in backward and its prefetched neighbour stay gathered, so no prefetch
        # here keeps the count at three groups

    def post_forward(self, g: int) -> None:
        if self.reshard_after_forward:
            self._drop(self.groups[g], _FORWARD)

    def pre_backward(self, g: int) -> None:
        # Reductions started by later groups finish before this group's gradients
        # exist: one unit's full-size gradients at a time, as FSDP2. (They started
        # when those groups' backward ended, right before this hook.)
        self._finish_reductions()
        group = self.groups[g]
        if self.gather and group.unread_in_backward and not group.holds:
            group.holds.add(_SHAPES)  # shapes, no values: nothing gathered
            for bucket in group.buckets:
                bucket.acquire_shapes(group.key)
        else:
            self._hold(group, _BACKWARD, wait=True)
        group.holds.discard(_PREFETCH)
        self._prefetch(g - 1, -1)

    def post_backward(self, g: int) -> None:
        group = self.groups[g]
        self._drop(group, _BACKWARD, _FORWARD, _SHAPES)  # free the parameters first, then
        self._kept_weight_grads(group)  # the weight gradients that waited for that,
        self._reduce(group)  # flatten and reduce-scatter the gradients

    # ------------------------------------------------- deferred weight gradients
    def linear(
        self, g: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """A linear layer of group ``g`` on a weight nothing else reads (from
        ``mpar.partition._gates.linear``). Its weight gradient waits for
        :meth:`post_backward` at ZeRO-3 when ``weight`` is in one of the group's unit
        buckets, whose memory can be freed in place, and keeping ``x`` and the
        output gradient until then costs no more than the weight's gradient kept
        apart from the gathered weight; otherwise autograd computes it, as always."""
        group = self.groups[g]
        rows = x.numel() // max(1, x.shape[-1]) if x.dim() else 1
        if (
            self.weight_grads is None
            or not self.gather
            or x.numel() + rows * weight.shape[0] > weight.numel()
            or not any(weight is p for b in group.buckets if b.grads.per_unit for p in b.params)
            or not all(b.gathers and _device.can_free_storage(b.device) for b in group.buckets)
        ):
            return _LINEAR(x, weight, bias)
        keep = functools.partial(self._keep_weight_grad, group)
        return self.weight_grads.linear(x, weight, bias, defer=keep)

    @staticmethod
    def _keep_weight_grad(
        group: UnitGroup, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor
    ) -> bool:
        group.kept.append((weight, None, x, dy))
        return True

    def _kept_weight_grads(self, group: UnitGroup) -> None:
        """Compute the kept weight gradients: the parameters get their shapes, without
        memory (:meth:`~mpar.shard._bucket.FlatBucket.acquire_shapes`), to take them."""
        if not group.kept or self.weight_grads is None:
            return
        key = (*group.key, "weight grads")
        for bucket in group.buckets:
            bucket.acquire_shapes(key)
        try:
            self.weight_grads.accumulate(group.kept)
        finally:
            group.kept.clear()
            for bucket in group.buckets:
                bucket.release(key)

    def _reduce(self, group: UnitGroup) -> None:
        units = [b for b in group.buckets if b.grads.per_unit]
        if not units:
            return
        if self.on_grads is not None:
            self.on_grads(units)
        for bucket in units:
            bucket.grads.reduce_unit()
        self.reducing.append(group)
        if self.on_grads is not None:
            self.on_grads(units)

    def _finish_reductions(self) -> None:
        while self.reducing:
            buckets = self.reducing.pop(0).buckets
            for bucket in buckets:
                bucket.grads.finish_reduce(to_host=False)
            if self.on_grads is not None:
                self.on_grads(buckets)  # their flat copies are freed: measured again

    # --------------------------------------------------------- stage-level ends
    def start(self, backward: bool) -> None:
        """The stage's UNSHARD: prefetch the group its next computation starts with."""
        if backward:
            self._prefetch(len(self.groups) - 1, -1)
        else:
            self._prefetch(0, 1)

    def after_forward(self) -> None:
        """After a forward of the stage: drop unused prefetches (and, with
        ``reshard_after_forward``, any forward hold a hook did not drop)."""
        for group in self.groups:
            reasons = (_PREFETCH, _FORWARD) if self.reshard_after_forward else (_PREFETCH,)
            if group.holds & set(reasons):
                self._drop(group, *reasons)

    def after_backward(self) -> None:
        """After a backward of the stage: free every group and start the
        reductions its hooks did not start."""
        for group in reversed(self.groups):
            if group.holds:
                self._drop(group, _PREFETCH, _FORWARD, _BACKWARD, _SHAPES)
            self._kept_weight_grads(group)
            if any(p.grad is not None for b in group.buckets if b.grads.per_unit for p in b.params):
                self._finish_reductions()
                self._reduce(group)

    def release_all(self) -> None:
        """The stage's RESHARD: nothing of it stays gathered."""
        for group in self.groups:
            if group.holds:
                self._drop(group, _PREFETCH, _FORWARD, _BACKWARD, _SHAPES)

    def gathered_groups(self) -> int:
        return sum(1 for group in self.groups if group.holds - {_SHAPES})
