"""One flat bucket of parameters on one rank: its storage in every ZeRO stage.

:class:`FlatBucket` holds the parameters (gathered and released at ZeRO-3, its
:class:`Residence`) and ``master``; its
:class:`~mpar.shard._bucket_grads.BucketGrads` (``bucket.grads``), made from the same
:class:`~mpar.shard._bucket_layout.BucketLayout`, holds the gradient buffers and runs
their reductions.

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
               into during the backward (or, fp32       first backward to
               under mixed precision, folded into)      its reduction
``grad_shard`` this rank's ``S`` reduced gradients      1, 2, 3; 0 while a
               (stage 0: the earlier steps' sum, set    step accumulates
               aside, ``_set_aside_reduced``)           before ``zero_grad``
``master``     the fp32 elements the optimizer          all (a view unless
               updates (``P`` at stage 0, else ``S``)   offloaded to CPU or
                                                        mixed precision)
``cpu_grad``   the gradient of an offloaded ``master``  offload_optimizer
               (in ``master``'s dtype)
=============  ======================================  =====================

Mixed precision (``compute_dtype`` bf16 or fp16): ``full`` and ``shard`` hold
the compute dtype (2 bytes an element) and the module's parameters become views
of that type; the gradient buffers hold ``grad_dtype``: float32 by default (each
backward's ``.grad`` is folded into ``staging``, see
:meth:`~mpar.shard._bucket_grads.BucketGrads.bind_grads`), the compute dtype
with ``reduce_dtype`` (then ``.grad`` views them); ``master`` is a separate copy in the
parameters' original dtype (fp32), the only one the optimizer updates, and
:meth:`FlatBucket.start_publish` rounds it back into the compute-dtype
parameters. With compute-dtype gradients the optimizer reads an fp32 copy of
the reduced gradient made at step time (:meth:`BucketGrads.opt_grad`),
multiplied by ``grad_factor`` (loss unscaling and clipping), so low-precision
gradients are never rescaled in place; fp32 ones are read and scaled as under fp32.

ZeRO-3 gathers reuse one ``full`` tensor per bucket: releasing it frees its
storage (and points the parameters at empty tensors), gathering grows the
storage back and refills it. Views of the parameters that autograd saved in a
forward (``t(weight)`` for a matrix product, say) are views of that storage:
they hold no memory while the bucket is released, and read the re-gathered
values in the backward, which must gather the bucket first.

*Unit buckets* (``ReduceOptions.per_unit``, ZeRO 2 and 3 with unit-granular gathering) hold
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

from collections.abc import Callable, Sequence
from enum import Enum

import torch
from torch import nn

from mpar import _device, _streams
from mpar.comm._shard_comm import all_gather_flat, broadcast_flat
from mpar.comm._types import Work
from mpar.shard._bucket_grads import BucketGrads
from mpar.shard._bucket_layout import BucketLayout, LayoutView, ReduceOptions

__all__ = ["FlatBucket", "Residence"]


class Residence(Enum):
    """Where a bucket's parameters are (:attr:`FlatBucket.residence`)."""

    REPLICATED = "replicated"
    """ZeRO 0-2, and ZeRO-3 in a group of one rank whose shard stays on the device:
    ``full`` holds every parameter, always (``shard`` is a view of it; a group of one
    has nothing to gather, so nothing is copied or freed)."""
    SHARDED = "sharded"
    """ZeRO-3, released: only this rank's ``shard``; ``full`` has no memory."""
    GATHERED = "gathered"
    """ZeRO-3: ``full`` holds every parameter (or will, once ``gathering`` is waited for)."""


class FlatBucket(LayoutView):
    """The storage of one bucket: its parameters (gathered, released, updated) and
    ``master``; its gradients and their reduction are :attr:`grads`.

    ``materialize`` is called on each parameter before it is copied in (a meta-built
    model); ``reduce`` says how the gradients are reduced (:attr:`grads` is made with it).
    """

    def __init__(
        self,
        layout: BucketLayout,
        *,
        reduce: ReduceOptions | None = None,
        materialize: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.layout = layout
        self.users: set[object] = set()
        """Local stages (or other keys) that currently hold this (ZeRO-3) bucket gathered."""
        self.gathering: _streams.Ticket | None = None
        """ZeRO-3: the gather started but not yet waited for (on the ``gather`` stream)."""
        self.dropped: list[_streams.Ticket] = []
        """ZeRO-3: gathers freed unused (a prefetch no hook read), which may still read
        ``shard``: the compute stream waits for them before the optimizer writes it
        (:meth:`settle`), not when they are dropped."""
        self.fenced = False
        """ZeRO-3: the gather stream is ordered after the last write of the parameters on
        the compute stream (see :meth:`_gather`)."""
        self.landing: list[_streams.Ticket] | None = None
        """Offloaded: what the host optimizer waits for before it steps this bucket, set
        at the end of the step's schedule (:meth:`ShardedStages.finish_grads`): the
        gradient's copy to the host and the gathers dropped unused that read the
        shard. None when not set since the last wait."""
        whole = layout.comm.size == 1 and not layout.offload_params  # the shard is all of it
        sharded = layout.zero_stage == 3 and not whole
        self.residence = Residence.SHARDED if sharded else Residence.REPLICATED
        self.full = torch.empty(0, dtype=self.dtype, device=self.device)
        """All ``P`` parameters (no memory while :attr:`residence` is ``SHARDED``)."""
        self.shard = self.full
        """This rank's ``S`` parameters (below ZeRO-3 a view of ``full``)."""
        self._views: list[torch.Tensor] = []
        """The parameters' views of ``full`` made by the last gather (see
        :meth:`acquire_shapes`)."""
        self.master = self._make_master(self._init_storage(materialize))
        self.grads = BucketGrads(layout, reduce or ReduceOptions())

    # ---------------------------------------------------------------- storage
    def _init_storage(self, materialize: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        """Fill ``full`` and ``shard``; returns the initial values of ``opt_range`` in
        the parameters' original dtype (what ``master`` starts from)."""
        sharded = self.residence is Residence.SHARDED
        flat: torch.Tensor | None = None
        for slot, p in zip(self.spec.slots, self.params):
            if materialize is not None:
                materialize(p)
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
        """Point the parameters at their views of ``full``: made once per storage (a
        freed and regrown ``full`` keeps its storage, and the views stay valid)."""
        views = self._views
        if not views or _device.storage_key(views[0]) != _device.storage_key(self.full):
            views = self._views = [
                self.full[slot.offset : slot.offset + slot.numel].view(shape)
                for slot, shape in zip(self.spec.slots, self.shapes)
            ]
        for p, view in zip(self.params, views):
            p.data = view

    def _release_params(self) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty

    @property
    def gathers(self) -> bool:
        """ZeRO-3 with parameters gathered before use and freed after (not a group of one
        rank that keeps its shard on the device, whose parameters stay in place)."""
        return self.residence is not Residence.REPLICATED

    @property
    def label(self) -> str:
        """The bucket in words, for the streams' records: ``"stage 1 bucket 3"``."""
        return f"stage {self.spec.stage} bucket@{self.spec.slots[0].index}"

    def _gather(self) -> _streams.Ticket:
        """Start gathering every rank's shard into ``full`` on the ``gather`` stream.

        An offloaded shard is first copied to the device on the ``copy_in`` stream,
        and the gather waits for that copy only. The first gather after the
        parameters were written on the compute stream (an optimizer step, a load)
        is fenced behind that write, once; later ones wait for nothing the compute
        stream does. ``full`` is allocated on the gather stream (so its memory is
        reused in that stream's order) and marked as used by the compute stream
        when the compute stream first reads it (:meth:`wait_gathered`)."""
        streams, after = self.streams, []
        shard = self.shard
        if not self.fenced:
            streams.fence("gather", self.label)
            streams.fence("copy_in", self.label)
            self.fenced = True
        if self.offload_params:
            moved: list[torch.Tensor] = []
            copy = lambda: moved.append(_device.to_device(self.shard, self.device))  # noqa: E731
            after.append(streams.issue("copy_in", self.label, copy))
            shard = moved[0]
            streams.used_on(shard, "gather")  # made on copy_in, read by the gather

        def gather() -> Work | None:
            self._grow_full()
            return all_gather_flat(
                self.full, shard, group=self.comm.group, size=self.comm.size, async_op=True
            )

        return streams.issue("gather", self.label, gather, after=after)

    def _grow_full(self) -> None:
        """Give ``full`` its memory back (on the current stream)."""
        if self.full.numel() == 0 or not _device.can_free_storage(self.device):
            self.full = torch.empty(self.spec.padded, dtype=self.dtype, device=self.device)
        else:
            _device.restore_storage(self.full)

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
        """Make the compute stream wait for a gather started by ``acquire(...,
        wait=False)`` (no-op otherwise): it is about to read these parameters."""
        ticket, self.gathering = self.gathering, None
        if ticket is not None:
            ticket.wait()
            self.streams.used_on(self.full, _streams.COMPUTE)

    def _drop_gather(self) -> None:
        """Before ``full`` is freed: a gather nobody waited for (an unused prefetch)
        finishes on its own stream. The compute stream does not wait for it: ``full``
        was allocated on the gather stream, so its memory is reused in that order."""
        ticket, self.gathering = self.gathering, None
        if ticket is not None:
            self.streams.wait(ticket, "gather")
            self.dropped.append(ticket)

    def settle(self) -> list[_streams.Ticket]:
        """End of the step's schedule: the compute stream waits for the gathers dropped
        unused, which read ``shard`` that the optimizer is about to update; returns
        their tickets."""
        dropped, self.dropped = self.dropped, []
        for ticket in dropped:
            ticket.wait()
        return dropped

    def wait_landed(self) -> None:
        """Block the host until what it waits for before stepping this bucket has run
        (:attr:`landing`); the caller counts the wait in the sync ledger."""
        landing, self.landing = self.landing or [], None
        for ticket in landing:
            self.streams.wait_host(ticket)

    def release(self, stage: object) -> None:
        """Drop ``stage``'s use (a stage index, or any key a caller acquired with);
        free the gathered copy when nothing uses it any more."""
        self.users.discard(stage)
        if self.users or self.residence is Residence.REPLICATED:
            return
        if self.residence is Residence.SHARDED:  # the shapes of acquire_shapes, if any
            self._release_params()
            return
        self._drop_gather()  # never free a buffer a collective is still writing
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
        self.fenced = False
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
        self.fenced = False
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
        self.fenced = False  # the next gather reads what the optimizer wrote
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


def _unmeta(params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
    """Parameters left on meta for a pending load: real (empty) tensors, the same
    objects, so that their ``.data`` can be set to views of the bucket."""
    from mpar._swap import replace_storage

    for p in params:
        if p.is_meta:
            replace_storage(p, torch.empty(0, dtype=dtype, device=device))
