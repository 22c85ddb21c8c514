"""``ShardedStages``: ZeRO storage and actions for one rank's pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpar import _device, _streams
from mpar.comm._collectives import group_size
from mpar.comm._types import ProcessGroup, Work
from mpar.config import ZeroConfig
from mpar.shard._bucket import FlatBucket, Residence
from mpar.shard._bucket_layout import BucketLayout, GroupInfo, ReduceOptions
from mpar.shard._byte_count import count_bytes
from mpar.shard._flat_layout import BucketSpec, plan_buckets
from mpar.shard._scaler import LossScaler
from mpar.shard._unit_gather import UnitGather, WeightGradHooks

if TYPE_CHECKING:
    from mpar.shard._sharded_optimizer import ShardedOptimizer

__all__ = ["MasterRun", "ShardedStages"]


def _collect(
    stages: Mapping[int, nn.Module],
) -> tuple[dict[int, list[nn.Parameter]], list[nn.Parameter]]:
    """Trainable parameters per stage (each under its lowest stage) and frozen ones."""
    seen: set[int] = set()
    owned: dict[int, list[nn.Parameter]] = {}
    frozen: list[nn.Parameter] = []
    for s in sorted(stages):
        owned[s] = []
        for p in stages[s].parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                owned[s].append(p)
            else:
                frozen.append(p)
    return owned, frozen


@dataclass(frozen=True)
class MasterRun:
    """Elements ``[start, stop)`` of one (flattened) parameter in this rank's slice of
    its bucket's master values: ``master[offset : offset + stop - start]``."""

    param: nn.Parameter
    shape: torch.Size
    """The parameter's shape (on this rank: its tensor-parallel piece when split)."""
    master: torch.Tensor
    """The bucket's master values over this rank's slice (full precision)."""
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class _BucketPlan:
    """What decides how this rank's parameters are bucketed and reduced (used while
    the buckets and unit groups are made)."""

    tied: Mapping[int, ProcessGroup | None]
    """``id`` of each tied parameter -> the group of ranks holding its copies."""
    unit_of: Mapping[int, tuple[int, int]]
    """``id`` of each parameter one unit group owns -> (stage, group)."""
    group_counts: Mapping[int, int]
    """Stage -> how many unit groups it has."""
    tp_split: frozenset[int] | None
    """``id`` of the parameters tensor parallelism splits (None without it)."""
    tp_size: int
    unread: frozenset[int]
    """``id`` of the parameters whose gradient reads none of their values."""
    per_microbatch: bool = True
    """``zero.reduce`` is ``"microbatch"``: unit groups reduce after each backward (else
    their buckets accumulate full-size gradients and reduce once per step)."""

    def reduce_options(self, first: nn.Parameter, zero_stage: int, ranks: int) -> ReduceOptions:
        """How the bucket whose first parameter is ``first``, sharded over ``ranks``
        ranks, reduces its gradients (a group of one has nothing to reduce: its unit
        buckets accumulate in place, once a step, as at ZeRO-0)."""
        tied = id(first) in self.tied
        group = self.tied.get(id(first))
        per_unit = id(first) in self.unit_of and zero_stage >= 2 and self.per_microbatch
        return ReduceOptions(
            per_unit=per_unit and ranks > 1,
            tied_group=group,
            tied_size=group_size(group) if tied else 1,
            # the same on every TP rank: its norm counts once
            norm_copies=self.tp_size
            if self.tp_split is not None and id(first) not in self.tp_split
            else 1,
        )


@dataclass(frozen=True)
class _StageBuckets:
    """The buckets of one local stage."""

    owned: list[FlatBucket]
    """Those it stores, reduces and updates (a parameter shared with a higher stage
    is the lower stage's)."""
    used: list[FlatBucket]
    """Those holding a parameter its module uses."""
    wide: list[FlatBucket]
    """Of ``used``, those it gathers as a whole (all of them without unit groups)."""


def _unit_index(
    owned: dict[int, list[nn.Parameter]],
    units: Mapping[int, Sequence[Sequence[nn.Parameter]]],
    tied: Collection[int],
) -> dict[int, tuple[int, int]]:
    """``id(param) -> (stage, group)`` for the parameters one group of their own stage
    owns (``tied`` ones excepted: they keep buckets of their own)."""
    out: dict[int, tuple[int, int]] = {}
    for s, groups in units.items():
        mine = {id(p) for p in owned.get(s, [])}
        for g, params in enumerate(groups):
            for p in params:
                if id(p) in mine and id(p) not in tied:
                    out[id(p)] = (s, g)
    return out


@dataclass
class Precision:
    """The dtypes a :class:`ShardedStages` computes and reduces in, and fp16's scaler."""

    compute: torch.dtype | None
    """bf16 / fp16 under mixed precision; None: fp32."""
    reduce: torch.dtype | None
    """What gradients accumulate and reduce in; None: the parameters' dtype (fp32)."""
    scaler: LossScaler | None
    """fp16 only: the dynamic loss scale the runtime multiplies losses by."""


@dataclass
class Peaks:
    """Peaks of a :class:`ShardedStages`' gathered parameters and gradient bytes since
    the last reset (``memory_report``)."""

    gathered: int = 0
    grads: int = 0


@dataclass(frozen=True)
class ExpertSharding:
    """Expert parameters (by ``id``) and the group they are reduced and sharded over
    (the expert-data-parallel group; the data-parallel one without experts)."""

    ids: frozenset[int]
    comm: GroupInfo


class ShardedStages:
    """ZeRO stages 0-3 (with CPU offload) over one data-parallel group.

    See the :mod:`mpar.shard` docstring for the contract. ``stages`` maps
    this rank's stage indices to their modules; a parameter that appears in
    two of them is stored, reduced and updated once, under the lower stage
    (whose last backward of a step comes last).

    ``compute_dtype`` (bf16 or fp16) turns on mixed precision: the stages'
    floating-point parameters and buffers are converted to it, and fp32
    master copies feed the optimizer (fp16 also gets a :class:`LossScaler`).
    Gradients then accumulate and are reduced in fp32 (``reduce_dtype`` None or
    ``torch.float32``; each backward's compute-dtype ``.grad`` is added into an fp32
    buffer); ``reduce_dtype=compute_dtype`` keeps them in the compute dtype (half the
    gradient bytes and reduction traffic, every sum rounded).
    ``tied`` lists ``(process group, parameter)`` for parameters that other
    pipeline ranks hold a copy of (same data-parallel index): each gets a
    bucket of its own, so every copy has the same layout, and its reduced
    gradient is summed over the group before the optimizer sees it.

    ``units`` (ZeRO 2 and 3) maps a stage to its groups of partition units, each
    the list of parameters that group alone uses, in execution order: those get
    buckets of their own, gathered and reduced group by group
    (:mod:`mpar.shard._unit_gather`; the runtime calls :meth:`unit_gather`'s hooks).
    Parameters of the stage in no group stay stage-wide.

    ``materialize`` (parameters on the meta device) is called on each parameter
    right before its bucket copies it in, so a stage of a meta-built model
    never exists whole on the rank (``mpar.meta``).

    ``unread_in_backward`` holds the ``id`` of parameters whose gradient needs
    none of their values (an embedding lookup's weight): at ZeRO-3 a unit group
    made only of such parameters is not gathered for its backward.

    ``weight_grads`` (the runtime's split backward) lets ZeRO-3 compute a linear
    layer's weight gradient after its unit's parameters are freed
    (:meth:`mpar.shard._unit_gather.UnitGather.linear`).

    ``experts`` holds the ``id`` of the parameters of this rank's experts under
    expert parallelism: they get buckets of their own over ``expert_comm``, the
    expert-data-parallel group (the ranks holding the same experts), whose gradients
    are summed and whose ZeRO state is sharded there; the data-parallel group's other
    ranks hold other experts.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        zero: ZeroConfig,
        *,
        group: ProcessGroup | None,
        group_ranks: Sequence[int],
        rank_in_group: int,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        tied: Sequence[tuple[ProcessGroup | None, nn.Parameter]] = (),
        units: Mapping[int, Sequence[Sequence[nn.Parameter]]] | None = None,
        materialize: Callable[[torch.Tensor], None] | None = None,
        tp_size: int = 1,
        tp_split: Collection[int] = (),
        unread_in_backward: Collection[int] = (),
        weight_grads: WeightGradHooks | None = None,
        experts: Collection[int] = (),
        expert_comm: GroupInfo | None = None,
    ) -> None:
        if not stages:
            raise ValueError("ShardedStages needs at least one stage module, got an empty dict")
        if not 0 <= rank_in_group < len(group_ranks):
            raise ValueError(
                f"rank_in_group {rank_in_group} is not a position in group_ranks {list(group_ranks)}"
            )
        if compute_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"compute_dtype must be torch.bfloat16, torch.float16 or None, got {compute_dtype}"
            )
        self.zero = zero
        self.device = torch.device(device)
        self._copies_pending = False
        """Offload: non-blocking copies to or from the host not yet waited for."""
        self.comm = GroupInfo(group, tuple(group_ranks), rank_in_group)
        if reduce_dtype not in (None, torch.float32, compute_dtype):
            raise ValueError(
                f"reduce_dtype must be None (fp32), torch.float32 or the compute_dtype "
                f"({compute_dtype}), got {reduce_dtype}"
            )
        self.experts = ExpertSharding(frozenset(experts), expert_comm or self.comm)
        scaler = LossScaler() if compute_dtype == torch.float16 else None
        self.precision = Precision(compute_dtype, reduce_dtype, scaler)
        owned, self.frozen = _collect(stages)
        self.params = [p for s in sorted(owned) for p in owned[s]]
        """Trainable local parameters, each once, in stage then module order."""
        plan = _BucketPlan(
            tied={id(p): group for group, p in tied},
            unit_of=_unit_index(owned, units or {}, {id(p) for _, p in tied}),
            group_counts={s: len(groups) for s, groups in (units or {}).items()},
            tp_split=frozenset(tp_split) if tp_size > 1 else None,
            tp_size=tp_size,
            unread=frozenset(unread_in_backward),
            per_microbatch=zero.reduce == "microbatch",
        )
        self.buckets = self._make_buckets(owned, plan, materialize)
        self.tied_buckets = [self._bucket_of(p) for _, p in tied]
        """Buckets of tied parameters, in the order of ``tied`` (the same on every rank)."""
        if compute_dtype is not None:
            self._cast_rest(compute_dtype)
        self.units: dict[int, UnitGather] = self._make_units(plan, weight_grads)
        """Stage -> its unit-granular gathering and reduction (stages with ``units``)."""
        self._stages = self._stage_buckets(stages)
        self.optimizer: ShardedOptimizer | None = None
        self.peaks = Peaks()
        self._grad_held: dict[int, int] = {}
        """``id(bucket)`` -> the bytes its gradient buffers held when last measured."""
        """Since the last :meth:`reset_peak` (the runtime resets it at the start of each
        step)."""

    @property
    def peak_gathered_bytes(self) -> int:
        """ZeRO-3: the most bytes of gathered (full) parameters held at once."""
        return self.peaks.gathered

    @property
    def peak_grad_bytes(self) -> int:
        """The most bytes of gradient buffers (flat buffers being accumulated into or
        reduced, reduced shards) held at once."""
        return self.peaks.grads

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.precision.compute

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.precision.reduce

    @property
    def scaler(self) -> LossScaler | None:
        return self.precision.scaler

    @property
    def expert_comm(self) -> GroupInfo:
        """The group expert parameters are reduced and sharded over."""
        return self.experts.comm

    def _stage_buckets(self, stages: Mapping[int, nn.Module]) -> dict[int, _StageBuckets]:
        unit_buckets = {id(b) for u in self.units.values() for g in u.groups for b in g.buckets}
        out = {}
        for s, module in stages.items():
            ids = {id(p) for p in module.parameters()}
            used = [b for b in self.buckets if any(id(p) in ids for p in b.params)]
            out[s] = _StageBuckets(
                owned=[b for b in self.buckets if b.spec.stage == s],
                used=used,
                wide=[b for b in used if id(b) not in unit_buckets],
            )
        return out

    def _make_units(
        self, plan: _BucketPlan, weight_grads: WeightGradHooks | None
    ) -> dict[int, UnitGather]:
        out: dict[int, UnitGather] = {}
        by_stage: dict[int, dict[int, list[FlatBucket]]] = {}
        for bucket in self.buckets:
            place = plan.unit_of.get(id(bucket.params[0]))
            if place is not None:
                by_stage.setdefault(place[0], {}).setdefault(place[1], []).append(bucket)
        for s, count in plan.group_counts.items():
            groups = by_stage.get(s, {})
            ordered = [groups.get(g, []) for g in range(count)]
            out[s] = UnitGather(
                s,
                ordered,
                gather=self.zero.stage == 3,
                reshard_after_forward=self.zero.reshard_after_forward,
                prefetch=self.zero.prefetch,
                on_gather=self._note_gathered,
                on_grads=self._note_grads,
                unread_in_backward=[
                    all(id(p) in plan.unread for b in buckets for p in b.params)
                    for buckets in ordered
                ],
                weight_grads=weight_grads,
            )
        return out

    def _note_gathered(self) -> None:
        self.peaks.gathered = max(self.peaks.gathered, self._gathered_bytes())

    def _note_grads(self, changed: Sequence[FlatBucket] | None = None) -> None:
        """Count the gradient bytes held now into the peak: those of ``changed`` buckets
        measured afresh, the others' as last measured (None: all afresh). The unit hooks
        name the buckets they touched, so a hook costs its own buckets, not the stage's."""
        for bucket in self.buckets if changed is None else changed:
            self._grad_held[id(bucket)] = _bucket_grad_bytes(bucket)
        self.peaks.grads = max(self.peaks.grads, sum(self._grad_held.values()))

    def _grad_bytes(self) -> int:
        """Bytes of the gradient buffers held now (each storage once per bucket)."""
        self._grad_held = {id(b): _bucket_grad_bytes(b) for b in self.buckets}
        return sum(self._grad_held.values())

    def _make_buckets(
        self,
        owned: dict[int, list[nn.Parameter]],
        plan: _BucketPlan,
        materialize: Callable[[torch.Tensor], None] | None,
    ) -> list[FlatBucket]:
        index = {id(p): i for i, p in enumerate(self.params)}
        if self.compute_dtype is not None:
            itemsize = self.compute_dtype.itemsize
        else:
            itemsize = max((p.element_size() for p in self.params), default=4)
        bucket_elems = max(1, int(self.zero.bucket_mb * 2**20) // itemsize)

        def kind(p: nn.Parameter) -> object:
            # A tied parameter's kind is its own: it gets a bucket to itself; a
            # unit group's parameters never share a bucket with another group's.
            tied = index[id(p)] if id(p) in plan.tied else None
            tp = None if plan.tp_split is None else id(p) in plan.tp_split
            return (p.dtype, p.device, tied, plan.unit_of.get(id(p)), tp)

        def specs_for(comm: GroupInfo, expert: bool) -> list[tuple[BucketSpec, GroupInfo]]:
            wanted: dict[int, Sequence[tuple[int, int, object]]] = {
                s: [
                    (index[id(p)], p.numel(), kind(p))
                    for p in ps
                    if (id(p) in self.experts.ids) == expert
                ]
                for s, ps in owned.items()
            }
            specs = plan_buckets(wanted, group_size=comm.size, bucket_elems=bucket_elems)
            return [(spec, comm) for spec in specs]

        out = []
        for spec, comm in specs_for(self.comm, False) + specs_for(self.expert_comm, True):
            params = [self.params[slot.index] for slot in spec.slots]
            layout = BucketLayout.make(
                spec,
                params,
                zero_stage=self.zero.stage,
                comm=comm,
                device=self.device,
                compute_dtype=self.compute_dtype,
                reduce_dtype=self.reduce_dtype,
                offload_optimizer=self.zero.offload_optimizer == "cpu",
                offload_params=self.zero.offload_params == "cpu",
            )
            reduce = plan.reduce_options(params[0], self.zero.stage, comm.size)
            out.append(FlatBucket(layout, reduce=reduce, materialize=materialize))
        return out

    def _bucket_of(self, param: nn.Parameter) -> FlatBucket:
        for bucket in self.buckets:
            if any(p is param for p in bucket.params):
                return bucket
        raise ValueError("a tied parameter is not a trainable parameter of these stages")

    def _cast_rest(self, dtype: torch.dtype) -> None:
        """Frozen parameters in the compute dtype too; buffers keep theirs.

        Buffers stay as the model made them (as FSDP2 leaves them): models keep
        some in float32 on purpose (rotary frequencies, batch-norm statistics), and
        a captured stage checks the dtype the model's code asked for.
        """
        for t in self.frozen:
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)

    @property
    def loss_scale(self) -> float:
        """What the runtime multiplies each loss by before backward (1 unless fp16)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def _stage(self, s: int) -> _StageBuckets:
        if s not in self._stages:
            raise ValueError(
                f"stage {s} is not held by this rank (local stages: {sorted(self._stages)})"
            )
        return self._stages[s]

    # ------------------------------------------------------------ schedule actions
    def unshard(self, s: int, *, wait: bool = True, whole: bool = True) -> None:
        """ZeRO-3: gather stage ``s``'s parameters into its module (no-op otherwise).

        ``wait=False`` only starts the gathers (the lowered schedule's UNSHARD,
        a prefetch); :meth:`wait_unsharded` completes them before ``s`` computes.
        With unit groups, ``whole=False`` gathers only the stage-wide buckets (the
        groups are gathered by their hooks); ``whole=True`` also holds every group
        until :meth:`reshard` (for work outside a step: state dicts, checkpoints).
        """
        for bucket in self._stage(s).wide:
            bucket.acquire(s, wait=wait)
        units = self.units.get(s)
        if units is not None and whole:
            for group in units.groups:
                for bucket in group.buckets:
                    bucket.acquire(s, wait=wait)
        self._note_gathered()

    def start_unshard(self, s: int, *, backward: bool = False) -> None:
        """The UNSHARD action: start gathering stage ``s``'s parameters (with unit
        groups: its stage-wide ones, and the group its next computation starts
        with: the first for a forward, the last for a ``backward``)."""
        self.unshard(s, wait=False, whole=False)
        units = self.units.get(s)
        if units is not None:
            units.start(backward)

    def wait_unsharded(self, s: int) -> None:
        """Wait for stage ``s``'s gathers started by :meth:`start_unshard`."""
        for bucket in self._stages[s].wide:
            bucket.wait_gathered()

    def reshard(self, s: int) -> None:
        """ZeRO-3: free stage ``s``'s gathered parameters, keeping the local shard."""
        for bucket in self._stage(s).used:
            bucket.release(s)
        units = self.units.get(s)
        if units is not None:
            units.release_all()

    def buckets_used_by(self, s: int) -> list[FlatBucket]:
        """The buckets holding a parameter stage ``s``'s module uses (what it gathers)."""
        return list(self._stage(s).used)

    def unit_gather(self, s: int) -> UnitGather | None:
        """Stage ``s``'s unit-group hooks (None when it gathers as a whole)."""
        return self.units.get(s)

    def after_forward(self, s: int) -> None:
        """After a forward of stage ``s`` (see :meth:`UnitGather.after_forward`)."""
        units = self.units.get(s)
        if units is not None:
            units.after_forward()

    def after_backward(self, s: int) -> None:
        """After a backward of stage ``s`` (see :meth:`UnitGather.after_backward`)."""
        self._note_grads()
        units = self.units.get(s)
        if units is not None:
            units.after_backward()

    def fold_grads(self) -> None:
        """Add the gradients written outside autograd (split backward's W) into the fp32
        buffers of buckets that fold (see :meth:`BucketGrads.bind_grads`); no-op else."""
        for bucket in self.buckets:
            bucket.grads.fold_all()

    def sync_from_params(self, s: int) -> None:
        """Stage ``s``'s (gathered) parameters were overwritten in place: update the
        shards and master copies from them."""
        for bucket in self._stage(s).used:
            bucket.sync_from_full()

    def reduce_grads(self, s: int) -> None:
        """Start the sum reduction of stage ``s``'s gradients (after its last backward)."""
        for bucket in self._stage(s).owned:
            bucket.grads.reduce()

    def bind_grads(self, s: int) -> None:
        """Before stage ``s``'s first backward of the step: its parameters' ``.grad``
        become views into the flat buffers their reduction sends (no copies)."""
        for bucket in self._stage(s).owned:
            if not bucket.grads.per_unit:
                bucket.grads.bind_grads()
        self._note_grads()

    def reduce_grads_in_backward(self, s: int) -> None:
        """Let stage ``s``'s next backward start its reductions bucket by bucket.

        Call it right before the stage's last backward of the step (the B
        followed by REDUCE_GRAD in the lowered schedule): each bucket's
        reduction then starts as soon as autograd has accumulated the last of
        its gradients, overlapping communication with the rest of the
        backward. ``reduce_grads(s)`` is still called after it and starts the
        buckets whose parameters got no gradient. Unit buckets reduce from the
        backward anyway; for them this marks the coming reduction as the step's
        last, whose offloaded result is then copied to the host right behind it.
        """
        for bucket in self._stage(s).owned:
            bucket.grads.arm()  # a unit bucket: marks its next reduction as the last

    def finish_grads(self) -> None:
        """Wait for every pending reduction (end of the step's schedule); tied
        parameters' gradients are then summed over their groups, in ``tied`` order."""
        tied = {id(b) for b in self.tied_buckets}
        for bucket in self.buckets:
            bucket.landing = bucket.settle()
            if id(bucket) not in tied:
                bucket.landing += _some(bucket.grads.finish_reduce())
        for bucket in self.tied_buckets:
            bucket.landing = (bucket.landing or []) + _some(bucket.grads.finish_reduce())
        # offloaded gradients are on their way to the host: the host optimizer (or the
        # clipping norm) waits for them when it reads them (:meth:`synchronize`, or
        # bucket by bucket: :meth:`landing_by_bucket`)
        self._copies_pending = self.offloads

    # ------------------------------------------------------------ full values
    def full_values(self) -> dict[int, torch.Tensor]:
        """``id(param) -> values`` of every trainable parameter, from the optimizer's
        master copies (full precision under mixed precision). Collective over the group."""
        out: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            flat = bucket.gather_master()
            for slot, p, shape in zip(bucket.spec.slots, bucket.params, bucket.shapes):
                out[id(p)] = flat[slot.offset : slot.offset + slot.numel].view(shape)
        return out

    def load_values(self, values: Mapping[int, torch.Tensor]) -> None:
        """Set parameters and master copies from ``id(param) -> tensor`` (every rank
        passes the same values; parameters not in ``values`` keep theirs)."""
        self.synchronize()
        for bucket in self.buckets:
            ids = [id(p) for p in bucket.params]
            flat = bucket.gather_master() if any(i not in values for i in ids) else None
            if flat is None:
                flat = torch.zeros(
                    bucket.spec.padded, dtype=bucket.master_dtype, device=self.device
                )
            else:
                flat = flat.clone()
            for slot, i in zip(bucket.spec.slots, ids):
                if i in values:
                    target = flat[slot.offset : slot.offset + slot.numel]
                    target.copy_(values[i].reshape(-1))
            bucket.load_values(flat)

    def master_runs(self) -> Iterator[MasterRun]:
        """Each run of a parameter's elements in this rank's slices of the master values
        (what a checkpoint saves and loads of the bucketed parameters)."""
        self.synchronize()  # a load writes them: no copy to the device still reads them
        for bucket in self.buckets:
            lo, hi = bucket.opt_range
            for slot, param, shape in zip(bucket.spec.slots, bucket.params, bucket.shapes):
                start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start < stop:
                    yield MasterRun(
                        param, shape, bucket.master, start - slot.offset, stop - slot.offset,
                        start - lo,
                    )  # fmt: skip

    def publish_masters(self) -> None:
        """Put the master values (updated, or loaded) back into the parameters: rounded
        to the compute dtype, all-gathered where the stage keeps full parameters
        (collective over the group)."""
        self.finish_publish([bucket.start_publish() for bucket in self.buckets])

    def finish_publish(self, works: Sequence[Work | None]) -> None:
        """Wait for the publishing collectives ``works`` (of every bucket's
        :meth:`FlatBucket.start_publish`, in the order started)."""
        for work in works:
            if work is not None:
                work.wait()
        for bucket in self.buckets:  # the copies just queued are not in any landing
            bucket.landing = None
        if self.offloads:  # copies from the host masters may still be reading them:
            self._copies_pending = True  # whatever writes them next waits (synchronize)

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffers the parameters are views into now (gathered ones at ZeRO-3)."""
        return [b.full for b in self.buckets if b.full.numel() > 0]

    def reset_peak(self) -> None:
        """Start counting ``peak_gathered_bytes`` and ``peak_grad_bytes`` afresh
        (from what is held now)."""
        self.peaks = Peaks(self._gathered_bytes(), self._grad_bytes())

    def _gathered_bytes(self) -> int:
        """Bytes of the full (gathered) parameter buffers held now (ZeRO-3)."""
        if self.zero.stage < 3:
            return 0
        return sum(b.full.nbytes for b in self.buckets if b.residence is Residence.GATHERED)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            bucket.grads.zero_grad(set_to_none)

    @property
    def offloads(self) -> bool:
        """Whether optimizer state (and with it the master values) lives on the host."""
        return self.zero.offload_optimizer == "cpu" or self.zero.offload_params == "cpu"

    def synchronize(self) -> None:
        """Wait for the non-blocking host/device copies (CUDA offload) issued since the
        last wait, if any: only the host's reads and writes of what they copy need it
        (the host optimizer's step; a load into the master values, which the copies
        that published them to the device may still be reading)."""
        if self._copies_pending:
            self._copies_pending = False
            _device.wait_copies(self.device, "offload copies")
        for bucket in self.buckets:
            bucket.landing = None

    def landing_by_bucket(self) -> bool:
        """Before the host optimizer's step: True when it may wait for each bucket's own
        copies (:meth:`FlatBucket.wait_landed`, in the order it steps them) instead of
        the whole device, so the first buckets step while the last ones' gradients are
        still on their way. That is when every bucket's landing was set at the end of
        this step's schedule and nothing was queued since (counted as one wait in the
        ledger), on side streams (whose tickets carry events; the host's one stream has
        none to wait for). Otherwise waits as :meth:`synchronize` does and returns False."""
        ready = all(b.landing is not None and b.streams.overlaps for b in self.buckets)
        if self._copies_pending and ready:
            self._copies_pending = False
            _device.SYNCS.count("offload copies")
            return True
        self.synchronize()
        return False

    # ------------------------------------------------------------ optimizer, report
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """The same optimizer class and hyperparameters over this rank's flat shards."""
        from mpar.shard._sharded_optimizer import ShardedOptimizer

        self.optimizer = ShardedOptimizer(self, optimizer)
        return self.optimizer

    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by device, then ``parameters``/``gradients``/``optimizer``."""
        groups: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "optimizer": []}
        groups["parameters"] += [p.data for p in self.frozen]
        groups["gradients"] += [p.grad for p in self.frozen if p.grad is not None]
        for bucket in self.buckets:
            for key, tensors in bucket.tensors().items():
                groups[key] += tensors
        if self.optimizer is not None:
            groups["optimizer"] += self.optimizer.state_tensors()
        return count_bytes(groups)


def _some(ticket: _streams.Ticket | None) -> list[_streams.Ticket]:
    return [] if ticket is None else [ticket]


def _bucket_grad_bytes(bucket: FlatBucket) -> int:
    """Bytes of ``bucket``'s gradient buffers held now (each storage once)."""
    tensors: list[torch.Tensor | None] = [*bucket.grads.in_flight()]
    if bucket.grads.per_unit:  # gradients autograd allocated, not yet flattened
        tensors += [p.grad for p in bucket.params]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is not None:
            key = _device.storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total
