"""The gradients of one flat bucket: accumulated, reduced over the group, kept reduced.

A :class:`BucketGrads` is made by its :class:`~mpar.shard._bucket.FlatBucket` from the
bucket's :class:`~mpar.shard._bucket_layout.BucketLayout` and
:class:`~mpar.shard._bucket_layout.ReduceOptions`; the tensors it may hold are in the
table of :mod:`mpar.shard._bucket`. Two small state machines say where it is:

* :class:`GradPhase`, the reduction's progress within a step::

      IDLE --arm--> ARMED --last gradient arrives--> REDUCING_EARLY --REDUCE_GRAD--> REDUCING
        \\-------------------------REDUCE_GRAD (reduce / reduce_unit)-------------------^
      REDUCING_EARLY / REDUCING --finish_reduce--> IDLE

* :class:`Held`, what the optimizer can read: nothing since ``zero_grad``, the reduced
  gradients on the device, or (offloaded) their sum copied to the CPU.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from mpar import _device, _streams
from mpar.comm._shard_comm import all_reduce_flat, reduce_scatter_flat
from mpar.shard._bucket_layout import BucketLayout, LayoutView, ReduceOptions

__all__ = ["BucketGrads", "GradPhase", "Held"]


class GradPhase(Enum):
    """Where a bucket's gradient reduction is in the step (:attr:`BucketGrads.phase`)."""

    IDLE = "idle"
    """No reduction in flight, none armed."""
    ARMED = "armed"
    """The next backward starts the reduction as soon as every parameter's gradient is
    final (:meth:`BucketGrads.arm`)."""
    REDUCING_EARLY = "reducing early"
    """In flight, started from the backward; the schedule's REDUCE_GRAD is still to come."""
    REDUCING = "reducing"
    """In flight (``pending``), until :meth:`BucketGrads.finish_reduce` waits for it."""


class Held(Enum):
    """The reduced gradients a bucket holds for the optimizer (:attr:`BucketGrads.held`)."""

    NONE = "none"
    """No reduction has landed since ``zero_grad``."""
    DEVICE = "device"
    """In ``grad_full`` (ZeRO-0) or ``grad_shard``."""
    HOST = "host"
    """Offloaded: ``cpu_grad`` holds this step's sum (what lands later is added to it)."""
    COPYING = "copying"
    """Offloaded: the step's last reduction is being copied to ``cpu_grad`` on the
    ``copy_out`` stream, from the backward (its ticket in ``unwaited``);
    :meth:`BucketGrads.finish_reduce` makes it ``HOST``."""


class _Reduction(NamedTuple):
    """A reduction in flight: its ticket (``reduce`` stream), where the result lands, and
    the buffer sent."""

    work: _streams.Ticket
    out: torch.Tensor
    flat: torch.Tensor


class BucketGrads(LayoutView):
    """The gradients of one bucket's parameters: accumulated in a flat buffer,
    reduced over the group, kept reduced for the optimizer."""

    def __init__(self, layout: BucketLayout, options: ReduceOptions) -> None:
        self.layout = layout
        self.options = options
        self.phase = GradPhase.IDLE
        self.held = Held.NONE
        self.grad_factor: float | torch.Tensor = 1.0
        """Mixed precision: factor applied to the reduced gradient when it is converted
        for the optimizer (1 / loss scale, times any clipping coefficient)."""
        self.staging: torch.Tensor | None = None
        """The flat gradient buffer ``.grad`` views point into (see :meth:`bind_grads`)."""
        self.pending: _Reduction | None = None
        """The reduction in flight (phase ``REDUCING_EARLY`` or ``REDUCING``)."""
        self.unwaited: list[_streams.Ticket] = []
        """Reductions landed on the ``reduce`` stream (:meth:`retire`) that the compute
        stream has not waited for yet: it does before the optimizer reads the result."""
        self.grad_full: torch.Tensor | None = None
        self.spare_grad: torch.Tensor | None = None
        """Stages 0-1: the last ``grad_full``, kept by ``zero_grad(set_to_none=True)``
        for the next reduction (as DDP keeps its buckets): no new allocation,
        page faults and zero fill of ``P`` elements every step."""
        self.grad_shard: torch.Tensor | None = None
        self.cpu_grad: torch.Tensor | None = None
        self.hooks: list[RemovableHandle] = []
        self.arrived: set[int] = set()
        self.fold_hooks: list[RemovableHandle] = []
        """While ``staging`` folds (:attr:`folds_grads`): the parameters' post-accumulate
        hooks that add each new ``.grad`` into it."""

    @property
    def per_unit(self) -> bool:
        """A unit bucket: gradients reduced after every backward (see the module docstring)."""
        return self.options.per_unit

    @property
    def has_grad(self) -> bool:
        """Whether a reduction has landed since the last ``zero_grad``."""
        return self.held is not Held.NONE

    def arm(self) -> None:
        """Start the reduction from the backward, once every parameter's gradient is final.

        Post-accumulate-grad hooks count the parameters whose gradient the
        next backward accumulates; the last one starts :meth:`start_reduce`. A unit
        bucket reduces from the backward anyway: armed, its next reduction is known
        to be the step's last (its offloaded copy can start right away).
        """
        self.disarm()
        if self.per_unit:
            self.phase = GradPhase.ARMED
            return
        self.hooks = [p.register_post_accumulate_grad_hook(self._arrive) for p in self.params]
        self.phase = GradPhase.ARMED

    def disarm(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.arrived = [], set()
        if self.phase is GradPhase.ARMED:
            self.phase = GradPhase.IDLE

    def _arrive(self, param: torch.Tensor) -> None:
        self.fold(param)
        self.arrived.add(id(param))
        if len(self.arrived) == len(self.params):
            self.disarm()
            self.start_reduce(last=True)
            self.phase = GradPhase.REDUCING_EARLY

    def reduce(self) -> None:
        """``reduce_grads``: start the reduction unless the backward already did."""
        if self.per_unit:
            self.reduce_unit()
            return
        self.disarm()
        if self.phase is GradPhase.REDUCING_EARLY:
            self.phase = GradPhase.REDUCING
        else:
            self.start_reduce(last=True)

    def reduce_unit(self) -> None:
        """Unit bucket: start reduce-scattering the gradients its parameters got since
        the last call (``.grad`` as autograd allocated them), to be added to
        ``grad_shard``. The previous reduction is retired first (:meth:`retire`), so at
        most one is in flight; no-op when no parameter has a gradient."""
        if all(p.grad is None for p in self.params):
            return
        last = self.phase is GradPhase.ARMED
        self.retire()
        self.start_reduce(last=last)

    def bind_grads(self) -> None:
        """Before the stage's first backward of a step: make every parameter's
        ``.grad`` a view into the flat buffer the reduction will send, so autograd
        accumulates in place (as DDP's ``gradient_as_bucket_view``): no gradient
        allocated per parameter, no copy into the buffer at reduction time.

        Gradients that already exist (a parameter shared with a stage whose
        backward ran first) are copied in; the others start at zero.
        """
        if self.staging is not None or self.pending is not None:
            return  # already bound or in flight
        if self.zero_stage == 0 and self.has_grad:
            self._set_aside_reduced()
        if self.folds_grads or self._released():
            self._bind_folding()
            return
        if self.grad_full is not None:
            return  # .grad already views grad_full
        self.staging = self._fill_flat(self._flat_grad())
        for slot, p, shape in zip(self.spec.slots, self.params, self.shapes):
            p.grad = self.staging[slot.offset : slot.offset + slot.numel].view(shape)

    def _set_aside_reduced(self) -> None:
        """ZeRO-0, a training step before ``zero_grad`` (gradients accumulated over several
        step calls, as ``loss.backward()`` twice in one process): the reduced sum of the
        earlier steps waits in ``grad_shard`` while this step's gradients accumulate from
        zero, and :meth:`_land` adds it to their all-reduced sum. Accumulating into the
        reduced buffer instead would all-reduce the earlier steps' sum again (dp times it)."""
        self.grad_shard, self.grad_full = self.grad_full, None
        for p in self.params:
            p.grad = None

    def _released(self) -> bool:
        """ZeRO-3 parameters released (shapeless) now: ``.grad`` cannot be bound to them
        (by unit with ``zero.reduce: "step"``, the stage's units are gathered one at a
        time), so the gradients fold into ``staging`` as they arrive."""
        return any(p.shape != shape for p, shape in zip(self.params, self.shapes))

    @property
    def folding(self) -> bool:
        """``staging`` is bound by folding (:meth:`_bind_folding`)."""
        return bool(self.fold_hooks)

    def _bind_folding(self) -> None:
        """:meth:`bind_grads` when ``.grad`` cannot view the buffer (compute-dtype ``.grad``
        and an fp32 buffer, or released ZeRO-3 parameters, :meth:`_released`): ``staging`` starts from the gradients that exist, and a post-accumulate hook on
        every parameter adds each ``.grad`` autograd produces into it and drops it (as
        Megatron's fp32 ``main_grad``). Gradients written outside autograd (split
        backward's W) are added by :meth:`fold_all`, which the runtime calls after W."""
        self.staging = self._fill_flat(self._flat_grad())
        for p in self.params:
            p.grad = None
        self.fold_hooks = [p.register_post_accumulate_grad_hook(self.fold) for p in self.params]

    def fold(self, param: torch.Tensor) -> None:
        """Add ``param.grad`` into ``staging`` (when folding, bound and it has one) and
        drop it: the next backward starts a new compute-dtype gradient."""
        if self.staging is None or param.grad is None or not self.folding:
            return
        slot = self.layout.slot_of[id(param)]
        self.staging[slot.offset : slot.offset + slot.numel].add_(param.grad.reshape(-1))
        param.grad = None

    def fold_all(self) -> None:
        """:meth:`fold` every parameter's gradient (those written outside autograd)."""
        for p in self.params:
            self.fold(p)

    def _unbind_folding(self) -> torch.Tensor:
        """The folded ``staging`` with every remaining gradient added; hooks removed."""
        self.fold_all()
        for hook in self.fold_hooks:
            hook.remove()
        self.fold_hooks = []
        if self.staging is None:
            raise RuntimeError("internal: a folding bucket reduces without its staging buffer")
        return self.staging

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

    def _check_can_reduce(self) -> None:
        if self.pending is not None:
            raise RuntimeError(
                f"reduce_grads for stage {self.spec.stage} was called twice before finish_grads"
            )
        if self.zero_stage == 0 and self.grad_full is not None and self.has_grad:
            raise RuntimeError(
                f"stage {self.spec.stage} already holds reduced gradients and no "
                f"bind_grads({self.spec.stage}) set them aside before this backward: call "
                "bind_grads before a stage's first backward of a step (the runtime does), "
                "or zero_grad() after each optimizer step"
            )

    def start_reduce(self, *, last: bool = False) -> None:
        """Flatten the parameters' gradients and start their (async) reduction; ``last``:
        the step's last one for this bucket (an offloaded result starts its copy to the
        host right behind it, :meth:`_copy_out`)."""
        self._check_can_reduce()
        own = self._grad_as_flat() if self.staging is None else None
        if self.staging is not None and self.folding:
            flat, self.staging = self._unbind_folding(), None
        elif self.staging is not None:
            flat, self.staging = self._fill_flat(self.staging), None
        elif own is not None:
            flat = own
        else:
            flat = self._fill_flat(self._flat_grad())
        for p in self.params:
            p.grad = None  # stage 0 points it into the reduced buffer when done
        self.pending = self._issue(flat)
        self.phase = GradPhase.REDUCING
        if last and self._copies_early():
            self._copy_out(self.pending)

    def _copies_early(self) -> bool:
        """Whether the step's last reduction is copied to the host from the backward:
        offloaded, on side streams, a plain copy (not added to a sum already there,
        not a tied bucket, summed over its group after landing)."""
        return (
            self.offload_optimizer
            and self.zero_stage >= 1
            and self.streams.overlaps
            and self.held is not Held.HOST
            and self.options.tied_group is None
        )

    def _copy_out(self, reduction: _Reduction) -> None:
        """Copy ``reduction``'s result to ``cpu_grad`` on the ``copy_out`` stream, after
        the reduction only (per bucket, during the backward, as DeepSpeed's offload);
        the compute stream waits for the copy in :meth:`finish_reduce`."""
        if self.cpu_grad is None:
            self.cpu_grad = _device.host_buffer(
                reduction.out.numel(), self.master_dtype, self.device
            )
        cpu, out = self.cpu_grad, reduction.out
        self.streams.used_on(out, "copy_out")  # made on compute or reduce, read here

        def copy() -> None:
            _device.copy_(cpu, out)

        ticket = self.streams.issue("copy_out", self._label, copy, after=[reduction.work])
        self.unwaited.append(ticket)
        self.held = Held.COPYING

    @property
    def _label(self) -> str:
        return f"stage {self.spec.stage} bucket@{self.spec.slots[0].index}"

    def _issue(self, flat: torch.Tensor) -> _Reduction:
        """Start the reduction of ``flat`` on the ``reduce`` stream, ordered after the
        gradients the compute stream has produced so far (a fence, not a wait of the
        compute stream). ``flat`` was made on the compute stream and is read by the
        reduce stream: marked as used there, so its memory outlives the reduction
        even once :meth:`_land` drops it."""
        group, size = self.comm.group, self.comm.size
        streams, label = self.streams, self._label
        streams.fence("reduce", label)
        streams.used_on(flat, "reduce")
        if self.zero_stage == 0:
            out = flat
            run = lambda: all_reduce_flat(flat, group=group, size=size, async_op=True)  # noqa: E731
        elif self.grad_shard is not None and self.options.tied_group is None:
            # the sum lands in the reduced shard: no shard-sized buffer in between
            # (tied copies are summed over their group per reduction, so not those)
            out = self.grad_shard
            run = lambda: reduce_scatter_flat(  # noqa: E731
                out, flat, group=group, size=size, async_op=True, accumulate=True
            )
        else:
            out = torch.empty(self.spec.shard_numel, dtype=self.grad_dtype, device=self.device)
            run = lambda: reduce_scatter_flat(out, flat, group=group, size=size, async_op=True)  # noqa: E731
        return _Reduction(streams.issue("reduce", label, run), out, flat)

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
            or grad.dtype != self.grad_dtype
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
        return torch.empty(self.spec.padded, dtype=self.grad_dtype, device=self.device)

    def finish_reduce(self, *, to_host: bool = True) -> _streams.Ticket | None:
        """Wait for the reduction and store its result (and its CPU copy if offloaded).

        ``to_host=False`` (a unit bucket between two backwards of a step) keeps
        the sum on the device, in the gradients' dtype as the reductions of a
        whole step would; the copy to the offloaded optimizer happens once, at
        the end of the step.

        Returns what the host waits for before it reads ``cpu_grad`` (the copy on
        the ``copy_out`` stream, or a marker behind a copy on the compute stream),
        or None when nothing is on its way to the host.
        """
        if not to_host:
            self.retire()
            return None
        landing = None
        while self.unwaited:
            ticket = self.unwaited.pop(0)
            ticket.wait()
            if ticket.stream == "copy_out":
                landing = ticket
        if self.phase is GradPhase.ARMED:  # a unit bucket whose last backward reduced nothing
            self.phase = GradPhase.IDLE
        if self.held is Held.COPYING:  # copied from the backward (_copy_out)
            if self.pending is not None:
                self._land(self.pending)
            self.held, self.grad_shard = Held.HOST, None
            return landing
        if self.pending is None:
            if to_host and self.offload_optimizer and self.grad_shard is not None:
                landing = self._to_cpu_grad(self.grad_shard)  # what earlier units' reductions left
                if self.held is Held.DEVICE:
                    self.held = Held.HOST
                return landing
            return None
        reduced = self._land(self.pending)
        if self.offload_optimizer and to_host:
            landing = self._to_cpu_grad(reduced)
            self.held = Held.HOST
            return landing
        if self.held is Held.NONE:
            self.held = Held.DEVICE
        return None

    def retire(self) -> None:
        """Land the reduction in flight on the ``reduce`` stream, without the compute
        stream waiting for it (a unit bucket between two of its backwards): the next
        reduction of this bucket follows it on that stream, and the compute stream
        waits for both in :meth:`finish_reduce`, where the optimizer needs them. On the
        host's one stream this waits for the collective, freeing the buffer it sent."""
        if self.pending is None:
            return
        ticket = self.pending.work
        self.streams.wait(ticket, "reduce")
        self.unwaited.append(ticket)
        with self.streams.on("reduce"):  # what landing computes follows the reduction
            self._land(self.pending, wait=False)
        if self.held is Held.NONE:
            self.held = Held.DEVICE

    def _land(self, reduction: _Reduction, *, wait: bool = True) -> torch.Tensor:
        """Wait for ``reduction`` (the compute stream, unless ``wait`` is false: see
        :meth:`retire`); keep its result (``grad_full`` or ``grad_shard``)."""
        work, out, flat = reduction
        self.pending, self.phase = None, GradPhase.IDLE
        if wait:
            work.wait()
        if self.zero_stage >= 1 and flat is not out and _device.can_free_storage(flat.device):
            # the sent buffer is scratch: free it now, as the next unit's reduction may
            # allocate its own right after; the backend can hold the tensor a little
            # past its wait (gloo's worker thread drops the work later), which left two
            # units' buffers alive now and then, beyond the plan's working set
            _device.free_storage(flat)
        tied = self.options.tied_group
        if tied is not None:  # every copy gets the sum of the copies' gradients
            all_reduce_flat(out, group=tied, size=self.options.tied_size)
        if self.zero_stage == 0:
            if self.grad_shard is not None:  # the earlier steps' sum (_set_aside_reduced)
                out.add_(self.grad_shard)
                self.spare_grad, self.grad_shard = self.grad_shard, None
            self.grad_full = out
            if self.folds_grads:
                return out  # .grad cannot view fp32: it stays None, as at ZeRO >= 1
            for slot, p, shape in zip(self.spec.slots, self.params, self.shapes):
                p.grad = out[slot.offset : slot.offset + slot.numel].view(shape)
            return out
        if self.grad_shard is not None and out is not self.grad_shard:
            out = self.grad_shard.add_(out)
        self.grad_shard = out
        return out

    def _to_cpu_grad(self, reduced: torch.Tensor) -> _streams.Ticket | None:
        """Copy ``reduced`` to ``cpu_grad`` (added to it when it already holds this step's
        sum at stages >= 1); the device shard is then dropped. Returns the marker the
        host waits for before reading ``cpu_grad`` (None: a blocking copy, landed)."""
        if self.cpu_grad is None:
            self.cpu_grad = _device.host_buffer(reduced.numel(), self.master_dtype, self.device)
        landing = None
        if self.held is Held.HOST and self.zero_stage >= 1:
            with _device.counted_wait("offloaded gradient sum"):  # a blocking copy
                self.cpu_grad.add_(reduced.to("cpu"))
        else:
            _device.copy_(self.cpu_grad, reduced)
            landing = self.streams.marker(_streams.COMPUTE, self._label)
        if self.zero_stage >= 1:
            self.grad_shard = None  # the device copy is no longer needed
        return landing

    def reduced_grad(self) -> torch.Tensor | None:
        """The reduced gradient of the optimizer's range, as stored (None before any
        reduction).

        Under mixed precision it is still to be multiplied by ``grad_factor``,
        except the CPU copy of offloaded ones, which is scaled in place.
        """
        if self.held is Held.NONE:
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
        factor = self.grad_factor
        if isinstance(factor, float) and factor == 1.0:
            return grad
        return grad.mul_(factor.to(grad.device) if isinstance(factor, torch.Tensor) else factor)

    def stepped(self) -> None:
        """The optimizer has read the gradient (:meth:`opt_grad`): its factor is spent."""
        self.grad_factor = 1.0

    def _own_slice(self, grad: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.own
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
        return total / (self.options.tied_size * self.options.norm_copies)

    def nonfinite(self) -> torch.Tensor:
        """1.0 (float32, on the device) if this rank's slice of the reduced gradient holds
        an inf or NaN, else 0.0; no host read."""
        grad = self.reduced_grad()
        if grad is None:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        bad = torch.logical_not(torch.isfinite(self._own_slice(grad))).any()
        return bad.to(device=self.device, dtype=torch.float32)

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply every reduced gradient this bucket holds by ``factor``
        (with compute-dtype gradients: ``grad_factor``, or the fp32 CPU copy in place).
        A tensor ``factor`` stays on the device, but for the CPU copy of offloaded
        gradients, which the host optimizer reads anyway."""
        if self.held is Held.NONE:
            return
        if self.grad_dtype != self.master_dtype and self.cpu_grad is None:
            self.grad_factor = self.grad_factor * factor
            return
        for grad in (self.grad_full, self.grad_shard, self.cpu_grad):
            if grad is not None:
                grad.mul_(_on(factor, grad.device))

    def zero_grad(self, set_to_none: bool) -> None:
        self.held = Held.NONE
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


def _on(factor: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """``factor`` usable to scale a tensor on ``device``: a device tensor moved to the
    host for a host tensor (the host optimizer reads it: a counted wait)."""
    if not isinstance(factor, torch.Tensor) or factor.device == device:
        return factor
    if _device.is_host(device) and not _device.on_host(factor):
        with _device.counted_wait("scale factor to the host optimizer"):
            return factor.to(device)
    return factor.to(device)
