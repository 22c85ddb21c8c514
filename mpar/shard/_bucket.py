"""One flat bucket of parameters on one rank: its storage in every ZeRO stage.

:class:`FlatBucket` holds the parameters (gathered and released at ZeRO-3, its
:class:`Residence`) and ``master``; its :class:`BucketGrads` (``bucket.grads``)
holds the gradient buffers and runs their reductions.

Tensors a bucket may hold (``P`` padded elements, ``n`` group size, ``S = P/n``):

=============  ======================================  =====================
name           what                                     stages
=============  ======================================  =====================
``full``       all ``P`` parameters; the module's       0-2 always, 3 while
               parameters are views into it             gathered (its storage
                                                        is freed in between)
``shard``      this rank's ``S`` parameters (CPU with   3 (below: a view of
               ``offload_params``)                      ``full``)
``grad_full``  reduced gradients of all ``P``; the      0
               parameters' ``.grad`` are views into it
``spare_grad`` ``grad_full`` after ``zero_grad``:        0
               reused by the next reduction
``staging``    the flat buffer ``.grad`` views point    all, from a stage's
               into during the backward                 first backward to
                                                        its reduction
``grad_shard`` this rank's ``S`` reduced gradients      1, 2, 3
``master``     the fp32 elements the optimizer          all (a view unless
               updates (``P`` at stage 0, else ``S``)   offloaded to CPU or
                                                        mixed precision)
``cpu_grad``   the gradient of an offloaded ``master``  offload_optimizer
               (in ``master``'s dtype)
=============  ======================================  =====================

Mixed precision (``compute_dtype`` bf16 or fp16): ``full``, ``shard`` and the
gradient buffers hold the compute dtype (2 bytes an element) and the module's
parameters become views of that type; ``master`` is a separate copy in the
parameters' original dtype (fp32), the only one the optimizer updates, and
:meth:`FlatBucket.start_publish` rounds it back into the compute-dtype
parameters. The optimizer reads an fp32 copy of the reduced gradient made at
step time (:meth:`BucketGrads.opt_grad`), multiplied by ``grad_factor`` (loss
unscaling and clipping), so low-precision gradients are never rescaled in place.

ZeRO-3 gathers reuse one ``full`` tensor per bucket: releasing it frees its
storage (and points the parameters at empty tensors), gathering grows the
storage back and refills it. Views of the parameters that autograd saved in a
forward (``t(weight)`` for a matrix product, say) are views of that storage:
they hold no memory while the bucket is released, and read the re-gathered
values in the backward, which must gather the bucket first.

*Unit buckets* (``unit_grads``, ZeRO 2 and 3 with unit-granular gathering) hold
one partition unit's parameters and reduce-scatter their gradients after every
backward of the unit (:meth:`BucketGrads.reduce_unit`), so only the unit being
differentiated has full-size gradients; the other buckets reduce once per
step, after the stage's last backward.

Stages 1 and 2 keep the same gradient state: the paper's stage 1 holds the
full reduced gradients (4 bytes per parameter) until the next step; here, as
in DeepSpeed, only this rank's slice of them survives the reduction, so
stage 1 holds no more than stage 2 between steps (full-size gradients exist
from a stage's first backward to its reduction at both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mpar import _device
from mpar.comm._shard_comm import (
    all_gather_flat,
    all_reduce_flat,
    broadcast_flat,
    reduce_scatter_flat,
)
from mpar.comm._types import ProcessGroup, Work
from mpar.shard._flat_layout import BucketSpec

__all__ = ["BucketGrads", "FlatBucket", "GroupInfo", "Residence"]


@dataclass(frozen=True)
class GroupInfo:
    """The data-parallel group a stage is sharded over."""

    group: ProcessGroup | None
    ranks: tuple[int, ...]
    """Global ranks of the group, in group order."""
    rank: int
    """This process's position in ``ranks``."""

    @property
    def size(self) -> int:
        return len(self.ranks)


class Residence(Enum):
    """Where a bucket's parameters are (:attr:`FlatBucket.residence`)."""

    REPLICATED = "replicated"
    """ZeRO 0-2: ``full`` holds every parameter, always (``shard`` is a view of it)."""
    SHARDED = "sharded"
    """ZeRO-3, released: only this rank's ``shard``; ``full`` has no memory."""
    GATHERED = "gathered"
    """ZeRO-3: ``full`` holds every parameter (or will, once ``gathering`` is waited for)."""


class _Reduction(NamedTuple):
    """A reduction in flight: its work handle, where the result lands, and the buffer sent."""

    work: Work | None
    out: torch.Tensor
    flat: torch.Tensor


class FlatBucket:
    """The storage of one bucket: its parameters (gathered, released, updated) and
    ``master``; its gradients and their reduction are :attr:`grads`."""

    def __init__(
        self,
        spec: BucketSpec,
        params: list[nn.Parameter],
        *,
        zero_stage: int,
        offload_optimizer: bool,
        offload_params: bool,
        comm: GroupInfo,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        materialize: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.spec = spec
        self.materialize = materialize
        """Called on each parameter before it is copied in (a meta-built model)."""
        self.params = params
        self.shapes = [p.shape for p in params]
        self.zero_stage = zero_stage
        self.comm = comm
        self.device = device
        self.master_dtype = params[0].dtype
        """The parameters' original dtype: what the optimizer updates."""
        self.dtype = compute_dtype or self.master_dtype
        """The dtype of parameters and gradients in compute (lower under mixed precision)."""
        self.lo, self.hi = spec.shard_range(comm.rank)
        self.offload_optimizer = offload_optimizer or offload_params
        self.offload_params = offload_params
        self.users: set[object] = set()
        """Local stages (or other keys) that currently hold this (ZeRO-3) bucket gathered."""
        self.gathering: Work | None = None
        """ZeRO-3: the work handle of a gather started but not yet waited for."""
        self.residence = Residence.REPLICATED if zero_stage < 3 else Residence.SHARDED
        self.full = torch.empty(0, dtype=self.dtype, device=device)
        """All ``P`` parameters (no memory while :attr:`residence` is ``SHARDED``)."""
        self.shard = self.full
        """This rank's ``S`` parameters (below ZeRO-3 a view of ``full``)."""
        self._views: list[torch.Tensor] = []
        """The parameters' views of ``full`` made by the last gather (see
        :meth:`acquire_shapes`)."""
        self.master = self._make_master(self._init_storage())
        self.grads = BucketGrads(self)

    # ---------------------------------------------------------------- storage
    @property
    def opt_range(self) -> tuple[int, int]:
        """Elements of the padded buffer this rank's optimizer updates."""
        if self.zero_stage == 0:
            return 0, self.spec.padded
        return self.lo, self.hi

    def _init_storage(self) -> torch.Tensor:
        """Fill ``full`` and ``shard``; returns the initial values of ``opt_range`` in
        the parameters' original dtype (what ``master`` starts from)."""
        sharded = self.residence is Residence.SHARDED
        flat: torch.Tensor | None = None
        for slot, p in zip(self.spec.slots, self.params):
            if self.materialize is not None:
                self.materialize(p)
            if p.is_meta:
                continue  # a pending load writes it (the same on every rank of the group)
            if flat is None:
                flat = torch.zeros(self.spec.padded, dtype=self.master_dtype, device=self.device)
            flat[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            if sharded:  # its own storage is freed now, not with the whole bucket's
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        lo, hi = self.opt_range
        _unmeta(self.params, self.dtype, self.device)
        if flat is None and sharded:  # all loaded later: only this rank's shard exists
            if self.offload_params:
                self.shard = _device.host_buffer(self.hi - self.lo, self.dtype, self.device)
                self.shard.zero_()
            else:
                self.shard = torch.zeros(self.hi - self.lo, dtype=self.dtype, device=self.device)
            self._release_params()
            return torch.zeros(hi - lo, dtype=self.master_dtype, device=self.device)
        if flat is None:
            flat = torch.zeros(self.spec.padded, dtype=self.master_dtype, device=self.device)
        else:  # like DDP: every replica starts from the group's first rank's values
            broadcast_flat(flat, src=self.comm.ranks[0], group=self.comm.group, size=self.comm.size)
        initial = flat[lo:hi]
        flat = flat.to(self.dtype)  # the same tensor unless mixed precision
        local = flat[self.lo : self.hi]
        if self.residence is Residence.REPLICATED:
            self.full, self.shard = flat, local
            self._bind_params()
            return initial
        if self.offload_params:
            self.shard = _device.host_buffer(local.numel(), self.dtype, self.device)
            self.shard.copy_(local)
        else:
            self.shard = local.clone()
        self._release_params()
        return initial

    def _make_master(self, initial: torch.Tensor) -> torch.Tensor:
        lo, hi = self.opt_range
        local = self.full[lo:hi] if self.residence is Residence.REPLICATED else self.shard
        if self.dtype != self.master_dtype:
            device = "cpu" if self.offload_optimizer else self.device
            if device == "cpu":
                master = _device.host_buffer(initial.numel(), self.master_dtype, self.device)
            else:
                master = torch.empty(initial.numel(), dtype=self.master_dtype, device=device)
            return master.copy_(initial)
        if not self.offload_optimizer or (self.offload_params and self.zero_stage == 3):
            return local  # the optimizer updates the parameters' own storage
        master = _device.host_buffer(local.numel(), self.dtype, self.device)
        master.copy_(local)
        return master

    def _bind_params(self) -> None:
        self._views = [
            self.full[slot.offset : slot.offset + slot.numel].view(shape)
            for slot, shape in zip(self.spec.slots, self.shapes)
        ]
        for p, view in zip(self.params, self._views):
            p.data = view

    def _release_params(self) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def _device_shard(self) -> torch.Tensor:
        return _device.to_device(self.shard, self.device)

    def _gather(self) -> Work | None:
        """Start gathering every rank's shard into ``full``."""
        return all_gather_flat(
            self.full, self._device_shard(), group=self.comm.group, size=self.comm.size,
            async_op=True,
        )  # fmt: skip

    # ------------------------------------------------------- ZeRO-3 gathering
    def acquire(self, stage: object, *, wait: bool = True) -> None:
        """Gather the full parameters for ``stage`` (ZeRO-3; no-op if gathered).

        With ``wait=False`` the gather only starts (a prefetch): the parameters
        are bound to the buffer it fills, and :meth:`wait_gathered` must run
        before they are read.
        """
        self.users.add(stage)
        if self.residence is not Residence.SHARDED:
            if wait:
                self.wait_gathered()
            return
        if self.full.numel() == 0 or not _device.can_free_storage(self.device):
            self.full = torch.empty(self.spec.padded, dtype=self.dtype, device=self.device)
        else:
            _device.restore_storage(self.full)
        self.gathering = self._gather()
        self.residence = Residence.GATHERED
        self._bind_params()
        if wait:
            self.wait_gathered()

    def acquire_shapes(self, user: object) -> None:
        """ZeRO-3: give the parameters their shapes but no memory, for ``user``'s
        backward when it reads none of their values (an embedding lookup's gradient
        needs only the indices), or to take gradients computed without them: autograd
        then accumulates their gradients as for gathered parameters, and nothing is
        gathered. Their values are undefined
        until :meth:`release`; if another user gathers the bucket meanwhile, the
        parameters are real again.

        The shapes are the views of ``full`` from the bucket's last gather, kept
        while its storage is freed (a view of freed storage cannot be made anew).
        Never gathered (or on XLA, whose buffers are reallocated): a plain
        :meth:`acquire`."""
        views = self._views
        if (
            self.residence is not Residence.SHARDED
            or not views
            or _device.storage_key(views[0]) != _device.storage_key(self.full)
        ):
            self.acquire(user)
            return
        self.users.add(user)
        for p, view in zip(self.params, views):
            p.data = view

    def wait_gathered(self) -> None:
        """Wait for a gather started by ``acquire(..., wait=False)`` (no-op otherwise)."""
        work, self.gathering = self.gathering, None
        if work is not None:
            work.wait()

    def release(self, stage: object) -> None:
        """Drop ``stage``'s use (a stage index, or any key a caller acquired with);
        free the gathered copy when nothing uses it any more."""
        self.users.discard(stage)
        if self.users or self.residence is Residence.REPLICATED:
            return
        if self.residence is Residence.SHARDED:  # the shapes of acquire_shapes, if any
            self._release_params()
            return
        self.wait_gathered()  # never free a buffer a collective is still writing
        if _device.can_free_storage(self.device):
            _device.free_storage(self.full)
        else:
            self.full = torch.empty(0, dtype=self.dtype, device=self.device)
        self.residence = Residence.SHARDED
        self._release_params()

    def load_values(self, flat: torch.Tensor) -> None:
        """Overwrite parameters and ``master`` from ``flat``: all ``P`` padded elements in
        the original dtype, the same on every rank of the group (no communication;
        under mixed precision ``master`` keeps the full precision of ``flat``)."""
        self.wait_gathered()
        lo, hi = self.opt_range
        with torch.no_grad():
            self.master.copy_(flat[lo:hi])
            if self.residence is not Residence.SHARDED:
                self.full.copy_(flat)
            if self.zero_stage == 3:
                self.shard.copy_(flat[self.lo : self.hi])

    def gather_master(self) -> torch.Tensor:
        """All ``P`` padded elements of ``master`` on every rank (collective at stages >= 1)."""
        if self.zero_stage == 0:
            return self.master
        out = torch.empty(self.spec.padded, dtype=self.master_dtype, device=self.device)
        all_gather_flat(
            out, self.master.to(self.device), group=self.comm.group, size=self.comm.size
        )
        return out

    def sync_from_full(self) -> None:
        """After the gathered parameters were overwritten in place (e.g. by
        ``load_state_dict``): refresh this rank's shard and master copy from them."""
        self.wait_gathered()
        if self.residence is Residence.SHARDED:
            return
        local = self.full[self.lo : self.hi]
        if not _device.same_memory(self.shard, local):
            self.shard.copy_(local)
        lo, hi = self.opt_range
        source = self.full[lo:hi]
        if not _device.same_memory(self.master, source):
            self.master.copy_(source)

    # --------------------------------------------------------- after a step
    def start_publish(self) -> Work | None:
        """Put the updated ``master`` back into the parameters; returns a work handle.

        Stages 1-2 all-gather the updated slices into ``full``; stage 3 writes
        its shard and re-gathers a bucket that is currently gathered.
        """
        lo, hi = self.opt_range
        if self.residence is Residence.REPLICATED:
            local = self.full[lo:hi]
            if not _device.same_memory(local, self.master):
                _device.copy_(local, self.master)
            if self.zero_stage == 0:
                return None
            return all_gather_flat(
                self.full, local, group=self.comm.group, size=self.comm.size, async_op=True
            )
        self.wait_gathered()
        if not _device.same_memory(self.shard, self.master):
            _device.copy_(self.shard, self.master)
        if self.residence is Residence.SHARDED:
            return None
        return self._gather()

    # ---------------------------------------------------------------- report
    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this bucket holds, by memory category."""
        params = [] if self.residence is Residence.SHARDED else [self.full]
        if self.zero_stage == 3:
            params.append(self.shard)
        return {
            "parameters": params,
            "gradients": self.grads.tensors(),
            "optimizer": [self.master],
        }


def _unmeta(params: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
    """Parameters left on meta for a pending load: real (empty) tensors, the same
    objects, so that their ``.data`` can be set to views of the bucket."""
    from mpar._swap import replace_storage

    for p in params:
        if p.is_meta:
            replace_storage(p, torch.empty(0, dtype=dtype, device=device))


class BucketGrads:
    """The gradients of one bucket's parameters: accumulated in a flat buffer,
    reduced over the group, kept reduced for the optimizer."""

    def __init__(self, bucket: FlatBucket) -> None:
        self.spec, self.params, self.shapes = bucket.spec, bucket.params, bucket.shapes
        self.zero_stage, self.comm, self.device = bucket.zero_stage, bucket.comm, bucket.device
        self.dtype, self.master_dtype = bucket.dtype, bucket.master_dtype
        self.offload_optimizer = bucket.offload_optimizer
        self.own = (bucket.lo, bucket.hi)
        """This rank's slice of the padded buffer."""
        self.grad_factor = 1.0
        """Mixed precision: factor applied to the reduced gradient when it is converted
        for the optimizer (1 / loss scale, times any clipping coefficient)."""
        self.staging: torch.Tensor | None = None
        """The flat gradient buffer ``.grad`` views point into (see :meth:`bind_grads`)."""
        self.pending: _Reduction | None = None
        self.grad_full: torch.Tensor | None = None
        self.spare_grad: torch.Tensor | None = None
        """Stages 0-1: the last ``grad_full``, kept by ``zero_grad(set_to_none=True)``
        for the next reduction (as DDP keeps its buckets): no new allocation,
        page faults and zero fill of ``P`` elements every step."""
        self.grad_shard: torch.Tensor | None = None
        self.cpu_grad: torch.Tensor | None = None
        self.has_grad = False
        """True once a reduction has landed since the last ``zero_grad``."""
        self.cpu_valid = False
        """Offload: ``cpu_grad`` holds gradients of this step (added to, not overwritten)."""
        self.hooks: list[RemovableHandle] = []
        self.arrived: set[int] = set()
        self.started_in_backward = False
        self.tied_group: ProcessGroup | None = None
        """Tied parameter (the bucket's only one): the group of ranks holding its copies."""
        self.tied_size = 1
        self.norm_copies = 1
        """Ranks outside the data-parallel group holding the same gradients (a parameter
        replicated over tensor parallelism): the global norm counts it once."""
        self.unit_grads = False
        """A unit bucket: gradients reduced after every backward (see the module docstring)."""

    def arm(self) -> None:
        """Start the reduction from the backward, once every parameter's gradient is final.

        Post-accumulate-grad hooks count the parameters whose gradient the
        next backward accumulates; the last one starts :meth:`start_reduce`.
        """
        self.disarm()
        self.hooks = [p.register_post_accumulate_grad_hook(self._arrive) for p in self.params]

    def disarm(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.arrived = [], set()

    def _arrive(self, param: torch.Tensor) -> None:
        self.arrived.add(id(param))
        if len(self.arrived) == len(self.params):
            self.disarm()
            self.start_reduce()
            self.started_in_backward = True

    def reduce(self) -> None:
        """``reduce_grads``: start the reduction unless the backward already did."""
        if self.unit_grads:
            self.reduce_unit()
            return
        self.disarm()
        if not self.started_in_backward:
            self.start_reduce()
        self.started_in_backward = False

    def reduce_unit(self) -> None:
        """Unit bucket: start reduce-scattering the gradients its parameters got since
        the last call (``.grad`` as autograd allocated them), to be added to
        ``grad_shard``. The previous reduction is finished first, so at most one is
        in flight; no-op when no parameter has a gradient."""
        if all(p.grad is None for p in self.params):
            return
        self.finish_reduce(to_host=False)
        self.start_reduce()

    def bind_grads(self) -> None:
        """Before the stage's first backward of a step: make every parameter's
        ``.grad`` a view into the flat buffer the reduction will send, so autograd
        accumulates in place (as DDP's ``gradient_as_bucket_view``): no gradient
        allocated per parameter, no copy into the buffer at reduction time.

        Gradients that already exist (a parameter shared with a stage whose
        backward ran first) are copied in; the others start at zero.
        """
        if self.staging is not None or self.pending is not None or self.grad_full is not None:
            return  # already bound, in flight, or .grad already views grad_full
        if self.zero_stage == 0 and self.has_grad:
            return  # start_reduce raises the error that explains this
        self.staging = self._fill_flat(self._flat_grad())
        for slot, p, shape in zip(self.spec.slots, self.params, self.shapes):
            p.grad = self.staging[slot.offset : slot.offset + slot.numel].view(shape)

    def _fill_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (uninitialised or stale) holding the parameters' current gradients,
        zero where a parameter has none and in the padding."""
        for slot, p in zip(self.spec.slots, self.params):
            target = flat[slot.offset : slot.offset + slot.numel]
            if p.grad is None:
                target.zero_()
            elif not _device.same_memory(p.grad, target):
                target.copy_(p.grad.reshape(-1))
        flat[self.spec.numel :].zero_()  # padding: summed and scaled, so kept at zero
        return flat

    def start_reduce(self) -> None:
        """Flatten the parameters' gradients and start their (async) reduction."""
        if self.pending is not None:
            raise RuntimeError(
                f"reduce_grads for stage {self.spec.stage} was called twice before finish_grads"
            )
        if self.zero_stage == 0 and self.has_grad:
            raise RuntimeError(
                f"stage {self.spec.stage} already holds reduced gradients: at ZeRO stage 0 "
                "call zero_grad() after each optimizer step (gradient accumulation across "
                "reductions needs ZeRO stage 1, 2 or 3)"
            )
        own = self._grad_as_flat() if self.staging is None else None
        if self.staging is not None:
            flat, self.staging = self._fill_flat(self.staging), None
        elif own is not None:
            flat = own
        else:
            flat = self._fill_flat(self._flat_grad())
        for p in self.params:
            p.grad = None  # stage 0 points it into the reduced buffer when done
        group, size = self.comm.group, self.comm.size
        if self.zero_stage == 0:
            work = all_reduce_flat(flat, group=group, size=size, async_op=True)
            self.pending = _Reduction(work, flat, flat)
        elif self.grad_shard is not None and self.tied_group is None:
            # the sum lands in the reduced shard: no shard-sized buffer in between
            # (tied copies are summed over their group per reduction, so not those)
            out = self.grad_shard
            work = reduce_scatter_flat(
                out, flat, group=group, size=size, async_op=True, accumulate=True
            )
            self.pending = _Reduction(work, out, flat)
        else:
            out = torch.empty(self.spec.shard_numel, dtype=self.dtype, device=self.device)
            work = reduce_scatter_flat(out, flat, group=group, size=size, async_op=True)
            self.pending = _Reduction(work, out, flat)

    def _grad_as_flat(self) -> torch.Tensor | None:
        """The only parameter's ``.grad`` itself as the buffer the reduce-scatter sends
        (scratch), when it is exactly that buffer: a bucket of one unpadded parameter
        whose gradient autograd allocated alone (a unit bucket of an embedding or LM
        head, say). No copy, and no second buffer of the bucket's size. None otherwise."""
        if self.zero_stage == 0 or len(self.params) != 1:
            return None
        grad = self.params[0].grad
        if (
            grad is None
            or grad.numel() != self.spec.padded
            or grad.dtype != self.dtype
            or grad.device != self.device
            or not grad.is_contiguous()
            or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()
        ):
            return None
        return grad.view(-1)

    def _flat_grad(self) -> torch.Tensor:
        """The buffer to flatten the gradients into (contents stale or uninitialised).

        ``grad_full`` when the parameters' gradients are views into it
        (``zero_grad(set_to_none=False)``); else the spare kept by ``zero_grad``;
        else a new one.
        """
        if self.grad_full is not None:
            return self.grad_full
        if self.spare_grad is not None:
            flat, self.spare_grad = self.spare_grad, None
            return flat
        return torch.empty(self.spec.padded, dtype=self.dtype, device=self.device)

    def finish_reduce(self, *, to_host: bool = True) -> None:
        """Wait for the reduction and store its result (and its CPU copy if offloaded).

        ``to_host=False`` (a unit bucket between two backwards of a step) keeps
        the sum on the device, in the gradients' dtype as the reductions of a
        whole step would; the copy to the offloaded optimizer happens once, at
        the end of the step.
        """
        if self.pending is None:
            if to_host and self.offload_optimizer and self.grad_shard is not None:
                self._to_cpu_grad(self.grad_shard)
            return
        work, out, flat = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        if self.zero_stage >= 1 and flat is not out and _device.can_free_storage(flat.device):
            # the sent buffer is scratch: free it now, as the next unit's reduction may
            # allocate its own right after; the backend can hold the tensor a little
            # past its wait (gloo's worker thread drops the work later), which left two
            # units' buffers alive now and then, beyond the plan's working set
            _device.free_storage(flat)
        if self.tied_group is not None:  # every copy gets the sum of the copies' gradients
            all_reduce_flat(out, group=self.tied_group, size=self.tied_size)
        if self.zero_stage == 0:
            self.grad_full = out
            for slot, p, shape in zip(self.spec.slots, self.params, self.shapes):
                p.grad = out[slot.offset : slot.offset + slot.numel].view(shape)
            reduced = out
        else:
            if self.grad_shard is not None and out is not self.grad_shard:
                out = self.grad_shard.add_(out)
            self.grad_shard = out
            reduced = out
        if self.offload_optimizer and to_host:
            self._to_cpu_grad(reduced)
        self.has_grad = True

    def _to_cpu_grad(self, reduced: torch.Tensor) -> None:
        if self.cpu_grad is None:
            self.cpu_grad = _device.host_buffer(reduced.numel(), self.master_dtype, self.device)
        if self.cpu_valid and self.zero_stage >= 1:
            self.cpu_grad.add_(reduced.to("cpu"))
        else:
            _device.copy_(self.cpu_grad, reduced)
        self.cpu_valid = True
        if self.zero_stage >= 1:
            self.grad_shard = None  # the device copy is no longer needed

    def reduced_grad(self) -> torch.Tensor | None:
        """The reduced gradient of the optimizer's range, as stored (None before any
        reduction).

        Under mixed precision it is still to be multiplied by ``grad_factor``,
        except the CPU copy of offloaded ones, which is scaled in place.
        """
        if not self.has_grad:
            return None
        if self.offload_optimizer:
            return self.cpu_grad
        if self.zero_stage == 0:
            return self.grad_full
        return self.grad_shard

    def opt_grad(self) -> torch.Tensor | None:
        """The gradient of ``master``, in its dtype (None before any reduction).

        Under mixed precision a new fp32 tensor the caller drops after the step.
        """
        grad = self.reduced_grad()
        if grad is None or grad.dtype == self.master_dtype:
            return grad
        grad = grad.to(self.master_dtype)
        return grad.mul_(self.grad_factor) if self.grad_factor != 1.0 else grad

    def _own_slice(self, grad: torch.Tensor) -> torch.Tensor:
        lo, hi = self.own
        return grad[lo:hi] if self.zero_stage == 0 else grad

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's slice of the reduced gradient (float32)."""
        grad = self.reduced_grad()
        if grad is None:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        total = self._own_slice(grad).float().pow(2).sum().to(self.device)
        if grad.dtype != self.master_dtype:
            total = total * self.grad_factor**2
        # each copy of a tied (or TP-replicated) parameter counts once overall
        return total / (self.tied_size * self.norm_copies)

    def grads_finite(self) -> bool:
        """Whether this rank's slice of the reduced gradient has no inf or NaN."""
        grad = self.reduced_grad()
        return grad is None or bool(torch.isfinite(self._own_slice(grad)).all())

    def scale_grads(self, factor: float) -> None:
        """Multiply every reduced gradient this bucket holds by ``factor``
        (under mixed precision: ``grad_factor``, or the fp32 CPU copy in place)."""
        if not self.has_grad:
            return
        if self.dtype != self.master_dtype:
            if self.cpu_grad is not None:
                self.cpu_grad.mul_(factor)
            else:
                self.grad_factor *= factor
            return
        for grad in (self.grad_full, self.grad_shard, self.cpu_grad):
            if grad is not None:
                grad.mul_(factor)

    def zero_grad(self, set_to_none: bool) -> None:
        self.has_grad = self.cpu_valid = False
        self.grad_factor = 1.0
        if set_to_none:
            if self.grad_full is not None:
                self.spare_grad = self.grad_full
            self.grad_full = self.grad_shard = None
            for p in self.params:
                p.grad = None
            return
        for grad in (self.grad_full, self.grad_shard):
            if grad is not None:
                grad.zero_()
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def in_flight(self) -> list[torch.Tensor]:
        """The gradient buffers being accumulated into or reduced, and the reduced shard."""
        tensors = [t for t in (self.staging, self.grad_full, self.grad_shard) if t is not None]
        if self.pending is not None:
            tensors += [self.pending.out, self.pending.flat]
        return tensors

    def tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor of the bucket (for the memory report)."""
        grads = [self.grad_full, self.spare_grad, self.grad_shard, self.cpu_grad, self.staging]
        grads += [p.grad for p in self.params]
        if self.pending is not None:
            grads += [self.pending.out, self.pending.flat]
        return [t for t in grads if t is not None]
