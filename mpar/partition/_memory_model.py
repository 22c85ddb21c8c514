"""The per-rank peak memory model and the time knobs of a layout (pure, no torch).

A :class:`MemoryLayout` names everything besides the partition that changes what a
rank holds: data-parallel degree and ZeRO stage, offload, precision,
activation checkpointing and the microbatch size relative to the profiled one.
The functions here turn a profile's per-unit figures into device bytes at the
*peak* of a step, following what the runtime allocates:

* parameters in the compute dtype (2 bytes an element under bf16/fp16); ZeRO-3
  keeps a ``1/dp`` shard (on the host with ``offload_params``);
* gradients: a full-size buffer from a stage's first backward to its
  once-per-step reduction at ZeRO-0/1 (microbatches accumulate into it); at
  ZeRO-2/3 the ``1/dp`` shard; in fp32 (4 bytes an element) under mixed precision
  unless ``low_precision_grads`` (``grad_reduce_dtype`` bf16 / fp16: 2 bytes);
* the ZeRO-2/3 working set (:func:`zero_working_set_bytes`), by the gather
  granularity (``MemoryLayout.gather``): by unit or group, two neighbouring units'
  (groups') gathered parameters at ZeRO-3 and, after a unit's backward, its
  gradients twice (autograd's, in the compute dtype, and the flat buffer they are
  copied into for the reduce-scatter, in the gradients' dtype); by chunk the
  stage's whole parameters and a full-size gradient buffer;
* optimizer state (and the fp32 master copy under mixed precision) divided by
  ``dp`` at ZeRO >= 1, nothing on the device with ``offload_optimizer`` or
  ``offload_params`` (the runtime offloads the optimizer with the parameters);
* activations saved for backward per microbatch in flight, plus the stage's
  output kept for its backward; with activation checkpointing only the stage's
  input and output per microbatch in flight, plus one microbatch's full
  activations while it is recomputed;
* the last stage's loss (:func:`loss_bytes`);
* pipeline messages (:class:`MessageCounts`): sends held until the peer has them
  (at most the microbatches in flight, so not growing with the number of
  microbatches) and one posted receive per incoming stream; one gradient bucket at
  ZeRO-0 when ``dp > 1``.

Where the memory is (``MemoryLayout.device``): offloaded state lives on the host
(:func:`unit_host_bytes`: the optimizer state, its fp32 master copy, the fp32
gradient the host optimizer reads, and the parameter shard with
``offload_params``). On a CUDA or XLA device that is another memory, reported
beside the device's; on a CPU device it is the same memory, so it counts in the
rank's peak and offload saves nothing (it adds the host gradient).

What a process holds besides tensors is added per rank by ``mpar.partition._planner``
(``CostModel.process_bytes``).

Profiles are taken in fp32 at one microbatch size; activations, outputs and
time scale linearly with ``microbatch_scale`` (samples per microbatch over the
profiled samples), an approximation that ignores fixed per-call costs.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mpar.config._schema import BlockCheckpointing
from mpar.errors import PartitionError
from mpar.schedule._csv import is_csv_path

if TYPE_CHECKING:
    from mpar.config import PrecisionKind
    from mpar.profile import UnitProfile

__all__ = [
    "DEVICES",
    "MemoryLayout",
    "MessageCounts",
    "PlanDevice",
    "effective_gather",
    "loss_bytes",
    "may_split_backward",
    "optimizer_step_bytes",
    "stage_extra_bytes",
    "transfer_bytes",
    "unit_activation_bytes",
    "Checkpointing",
    "SELECTIVE_KEPT",
    "block_strategy",
    "recompute_peak_bytes",
    "unit_held_bytes",
    "unit_host_bytes",
    "unit_state_bytes",
    "working_set_for_solver",
    "zero_working_set_bytes",
]

_PRECISIONS: tuple[PrecisionKind, ...] = ("fp32", "bf16", "fp16")

Checkpointing = bool | Literal["block"] | BlockCheckpointing
"""Activation checkpointing as the planner models it: off, by stage chunk (True), or
by block ("block": each unit keeps its input and is recomputed alone; a
:class:`~mpar.config.BlockCheckpointing`: every k-th unit, selectively or not, as the
config's ``activation_checkpointing`` runs it)."""

SELECTIVE_KEPT = 0.5
"""The share of a block's saved activations that selective checkpointing keeps (its
matrix products' outputs), an estimate: in a transformer block the products' outputs
(q, k, v, attention out, MLP up and down) are about half of what the block saves."""


def block_strategy(checkpointing: Checkpointing) -> BlockCheckpointing | None:
    """The per-block strategy of ``checkpointing`` ("block": every unit), else None."""
    if isinstance(checkpointing, BlockCheckpointing):
        return checkpointing
    return BlockCheckpointing() if checkpointing == "block" else None


PlanDevice = Literal["cuda", "xla", "cpu"]
"""A device kind the ranks compute on; on ``"cpu"`` host memory is the device's memory."""
DEVICES: tuple[PlanDevice, ...] = ("cuda", "xla", "cpu")


def may_split_backward(pipeline: str) -> bool:
    """Whether ``pipeline`` may split the backward into input (I) and weight (W) actions:
    ``zero_bubble``, ``zbv`` and schedule CSVs."""
    return pipeline in ("zero_bubble", "zbv") or is_csv_path(pipeline)


def effective_gather(pipeline: str, gather: str | int = "unit") -> str | int:
    """How ZeRO 2 and 3 gather and reduce inside a stage under ``pipeline``.

    ``gather`` (the config's ``zero.gather``: ``"unit"``, ``"chunk"`` or an int ``n``),
    except ``"chunk"`` for schedules that split the backward (:func:`may_split_backward`):
    their weight gradients are computed after the input gradients, outside the order
    the unit hooks follow. The runtime (``mpar.runtime._sharding``) and the planner
    both ask this function, so what is predicted and what runs cannot drift apart.
    """
    return "chunk" if may_split_backward(pipeline) else gather


def _check_gather(gather: object) -> None:
    if gather in ("unit", "chunk"):
        return
    if isinstance(gather, bool) or not isinstance(gather, int) or gather < 1:
        raise PartitionError(
            f'gather must be "unit" (one partition unit at a time), "chunk" (a whole '
            f"stage at once) or an int >= 1 (that many consecutive units), got {gather!r}"
        )


@dataclass(frozen=True)
class MemoryLayout:
    """The memory- and time-relevant knobs of one layout, apart from the partition."""

    data_parallel_degree: int = 1
    zero_stage: int = 0
    precision: PrecisionKind = "fp32"
    """"fp32", or "bf16" / "fp16" mixed precision (compute dtype, fp32 master weights)."""
    activation_checkpointing: Checkpointing = False
    """False; True: by stage chunk; "block" or a ``BlockCheckpointing``: by unit
    (``unit_held_bytes``)."""
    offload_optimizer: bool = False
    offload_params: bool = False
    microbatch_scale: float = 1.0
    """Samples per microbatch divided by the samples of the profiled microbatch."""
    bucket_bytes: int = 25 * 2**20
    """One gradient-reduction bucket (``zero.bucket_mb``)."""
    low_precision_grads: bool = False
    """Mixed precision only: gradients accumulate and reduce in the compute dtype
    (``grad_reduce_dtype`` bf16 / fp16) instead of fp32."""
    gather: str | int = "unit"
    """ZeRO 2/3 granularity inside a stage, as the runtime runs it: ``"unit"``, an int
    ``n`` (groups of ``n`` consecutive units) or ``"chunk"`` (the whole stage). Pass
    :func:`effective_gather` of the pipeline and ``zero.gather``."""
    device: PlanDevice = "cuda"
    """The device kind the ranks compute on: ``"cuda"`` / ``"xla"`` (offloaded state
    leaves the device for the host) or ``"cpu"`` (the host *is* the device: offloaded
    state counts in the same memory)."""
    prefetch: int = 1
    """ZeRO-3 by unit or group: groups gathered ahead of the one computing
    (``zero.prefetch``)."""
    reduce: str = "microbatch"
    """ZeRO 2/3 by unit or group: ``"microbatch"`` reduce-scatters each group's gradients
    after each of its backwards; ``"step"`` accumulates the stage's full-size gradients
    and reduces them once a step (``zero.reduce``)."""
    weight_work: bool = False
    """Whether the schedule splits the backward (:func:`may_split_backward`, with the
    config's ``split_backward`` on): a microbatch whose W waits holds its linear layers'
    inputs and output gradients (``UnitProfile.weight_work_bytes``), which may exceed
    what its forward saved."""
    expert_parallel_degree: int = 1
    """Ranks splitting each MoE layer's experts, folded into dp: a unit's experts
    (``UnitProfile.expert_param_bytes``) are sharded over the ``dp / ep`` ranks holding
    the same experts instead of over dp."""

    def __post_init__(self) -> None:
        if self.data_parallel_degree < 1:
            raise PartitionError(
                f"data_parallel_degree must be >= 1, got {self.data_parallel_degree}"
            )
        if (
            self.expert_parallel_degree < 1
            or self.data_parallel_degree % self.expert_parallel_degree
        ):
            raise PartitionError(
                f"expert_parallel_degree {self.expert_parallel_degree} must divide "
                f"data_parallel_degree {self.data_parallel_degree}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise PartitionError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.precision not in _PRECISIONS:
            raise PartitionError(
                f"precision must be one of {', '.join(_PRECISIONS)}, got {self.precision!r}"
            )
        if self.offload_params and self.zero_stage != 3:
            raise PartitionError("offload_params needs zero_stage 3 (parameter sharding)")
        if self.offload_optimizer and self.zero_stage == 0:
            raise PartitionError("offload_optimizer needs zero_stage >= 1")
        if not self.microbatch_scale > 0:
            raise PartitionError(f"microbatch_scale must be > 0, got {self.microbatch_scale!r}")
        _check_gather(self.gather)
        if (
            isinstance(self.prefetch, bool)
            or not isinstance(self.prefetch, int)
            or self.prefetch < 0
        ):
            raise PartitionError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.reduce not in ("microbatch", "step"):
            raise PartitionError(f'reduce must be "microbatch" or "step", got {self.reduce!r}')
        if self.device not in DEVICES:
            raise PartitionError(
                f"device must be one of {', '.join(DEVICES)} (the kind the ranks compute on), "
                f"got {self.device!r}"
            )

    @property
    def reduces_per_microbatch(self) -> bool:
        """Whether ZeRO 2/3 reduce-scatter per group after each backward (``"unit"`` or
        groups with ``reduce: "microbatch"``), rather than once per step."""
        return self.zero_stage >= 2 and self.gather != "chunk" and self.reduce == "microbatch"

    @property
    def host_is_device(self) -> bool:
        """Whether offloaded state stays in the device's memory (a CPU device)."""
        return self.device == "cpu"

    @property
    def offloads_optimizer(self) -> bool:
        """Whether the optimizer runs on the host: ``offload_optimizer``, or
        ``offload_params`` (the runtime offloads the optimizer with the parameters)."""
        return self.offload_optimizer or self.offload_params

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def dtype_factor(self) -> float:
        """Compute-dtype bytes relative to the fp32 profile."""
        return 0.5 if self.mixed else 1.0

    @property
    def grad_factor(self) -> float:
        """Bytes of the gradient buffers relative to the fp32 profile: fp32 under mixed
        precision too, unless ``low_precision_grads``."""
        return self.dtype_factor if self.low_precision_grads else 1.0

    @property
    def shards(self) -> int:
        """How many ways optimizer state is split."""
        return self.data_parallel_degree if self.zero_stage >= 1 else 1

    def sharded(self, whole: float, experts: float, ways: int) -> float:
        """This rank's part of ``whole`` bytes (of which ``experts`` are its experts')
        split ``ways`` ways over dp (1: kept whole): the experts' over the
        ``ways / ep`` ranks holding the same experts."""
        return (whole - experts) / ways + experts / max(ways // self.expert_parallel_degree, 1)


def _expert_optimizer(unit: UnitProfile) -> float:
    """The part of the unit's optimizer state that is its experts' (it follows the
    trainable parameters)."""
    return (
        unit.optimizer_bytes * unit.expert_grad_bytes / unit.grad_bytes if unit.grad_bytes else 0.0
    )


def unit_state_bytes(unit: UnitProfile, layout: MemoryLayout) -> float:
    """Device bytes of a unit's parameters, gradients and optimizer state between steps
    and while other units run (what is gathered or staged only while the unit itself
    computes is in :func:`zero_working_set_bytes`). On a CPU device the offloaded
    state (:func:`unit_host_bytes`) is in the same memory and included. Under expert
    parallelism the unit's experts are sharded over the expert-data-parallel group."""
    c, dp = layout.dtype_factor, layout.data_parallel_degree
    params = c * unit.param_bytes
    if layout.zero_stage == 3:  # this rank's shard
        params = (
            0.0
            if layout.offload_params
            else layout.sharded(params, c * unit.expert_param_bytes, dp)
        )
    g = layout.grad_factor
    grads = g * unit.grad_bytes
    if layout.zero_stage >= 2:  # reduce-scattered per unit as produced: only the shard stays
        grads = layout.sharded(grads, g * unit.expert_grad_bytes, dp)
    optim = 0.0
    if not layout.offloads_optimizer:
        master = unit.grad_bytes if layout.mixed else 0  # fp32 copy of trainable parameters
        expert = _expert_optimizer(unit) + (unit.expert_grad_bytes if layout.mixed else 0)
        optim = layout.sharded(unit.optimizer_bytes + master, expert, layout.shards)
    host = unit_host_bytes(unit, layout) if layout.host_is_device else 0.0
    return params + grads + optim + host


def unit_host_bytes(unit: UnitProfile, layout: MemoryLayout) -> float:
    """Host bytes a rank keeps for a unit when it offloads (``FlatBucket`` on the host):
    the optimizer state and the fp32 master copy it updates (the parameter shard itself
    in fp32 with ``offload_params``, else a copy), the fp32 gradient the host optimizer
    reads (``cpu_grad``, kept for the whole run), and under mixed precision with
    ``offload_params`` the compute-dtype parameter shard beside the master. All ``1/dp``
    shards (offload needs ZeRO >= 1). 0 without offload. Pinned on CUDA."""
    if not layout.offloads_optimizer:
        return 0.0
    shards, dp, xg = layout.shards, layout.data_parallel_degree, unit.expert_grad_bytes
    master = layout.sharded(unit.grad_bytes, xg, shards)  # fp32 trainable parameters
    optim = layout.sharded(unit.optimizer_bytes, _expert_optimizer(unit), shards)
    host = optim + 2 * master  # + cpu_grad
    if layout.offload_params and layout.mixed:
        c = layout.dtype_factor
        host += layout.sharded(c * unit.param_bytes, c * unit.expert_param_bytes, dp)
    elif layout.offload_params:  # fp32: the shard is the master; frozen ones too
        frozen = unit.param_bytes - unit.grad_bytes
        host += layout.sharded(frozen, unit.expert_param_bytes - xg, dp)
    return host


def _gather_groups(units: Sequence[UnitProfile], gather: str | int) -> list[list[UnitProfile]]:
    """The stage's units as the runtime gathers them: one each (``"unit"``), ``n``
    consecutive ones from the stage's first (an int), or all at once (``"chunk"``)."""
    size = len(units) if gather == "chunk" else 1 if gather == "unit" else int(gather)
    return [list(units[i : i + size]) for i in range(0, len(units), max(size, 1))]


def zero_working_set_bytes(units: Sequence[UnitProfile], layout: MemoryLayout) -> float:
    """ZeRO-2/3 bytes a stage of ``units`` holds only while it computes.

    By ``layout.gather`` (``mpar.shard._unit_gather``; the groups of :func:`_gather_groups`):

    * ``"unit"`` / an int ``n``: at ZeRO-3 at most two neighbouring groups' full
      parameters are gathered at once (the one running and the prefetched next, in
      forward or backward order); at ZeRO-2/3, after a group's backward, its
      gradients exist twice (autograd's ``.grad`` and the flat buffer they are copied
      into for the reduce-scatter, ``FlatBucket.reduce_unit``). The figure is the
      largest over the stage's groups of the two together. ``layout.prefetch`` groups
      are gathered ahead instead of one. With ``reduce: "step"`` the stage's
      gradients accumulate full-size (:func:`_step_grad_bytes`, additive over the
      units) and a group's ``.grad`` exist once more only where they fold into that
      buffer (ZeRO-3, or an fp32 buffer under mixed precision);
    * ``"chunk"``: at ZeRO-3 the whole stage is gathered from its UNSHARD to its
      RESHARD, and at ZeRO-2/3 its gradients accumulate into a full-size buffer
      (``FlatBucket.staging``, the ``.grad`` are views of it) from its first backward
      to its once-per-step reduction. A rank's stages add up (``mpar.partition._planner``
      sums them): under ``interleaved``, ``zero_bubble`` and ``zbv`` with ``v`` virtual
      stages the lowered schedule (``lower_sharding``, prefetch 1) holds all ``v``
      chunks of a rank gathered, and all ``v`` gradient buffers, at once. GPipe
      (``simple``) holds at most two chunks gathered and one gradient buffer, so there
      the sum over-predicts for ``v`` > 2 (gathers) and ``v`` > 1 (gradients).

    All in the compute dtype. This is the one place to change when the runtime's
    gather or reduction granularity changes.
    """
    if layout.zero_stage < 2:
        return 0.0
    groups = _gather_groups(units, layout.gather)
    params = [sum(u.param_bytes for u in group) for group in groups]
    neighbours = _gathered_neighbours(params, layout.prefetch)
    moment = max(
        (_group_moment(groups, params, neighbours, layout, g) for g in range(len(groups))),
        default=0.0,
    )
    return moment + sum(_step_grad_bytes(u, layout) for u in units)


def _gathered_neighbours(params: Sequence[int], n: int) -> list[int]:
    """Per group, the larger of the summed parameter bytes of its ``n`` nearest groups
    before it and of its ``n`` nearest after it, among the groups with any (the prefetch
    skips groups with nothing to gather); one pass each way, not a scan per group."""

    def nearest(order: Iterable[int]) -> list[int]:
        sums: list[int] = []
        kept: collections.deque[int] = collections.deque(maxlen=max(n, 0))
        for p in order:
            sums.append(sum(kept))
            if p:
                kept.append(p)
        return sums

    before, after = nearest(params), nearest(reversed(params))[::-1]
    return [max(b, a) for b, a in zip(before, after)]


def _step_grad_bytes(unit: UnitProfile, layout: MemoryLayout) -> float:
    """A unit's full-size gradients held from the stage's first backward to its
    once-per-step reduction (``reduce: "step"`` by unit or group; by chunk
    :func:`_group_moment` counts them with the chunk), else 0."""
    if layout.zero_stage < 2 or layout.gather == "chunk" or layout.reduces_per_microbatch:
        return 0.0
    if layout.data_parallel_degree == 1:
        return 0.0
    return layout.grad_factor * unit.grad_bytes


def _group_moment(
    groups: Sequence[Sequence[UnitProfile]],
    params: Sequence[int],
    neighbours: Sequence[int],
    layout: MemoryLayout,
    g: int,
) -> float:
    """The working set while group ``g`` is differentiated: its parameters and a
    neighbour's gathered (ZeRO-3), and its gradients (ZeRO-2/3); ``params``: each
    group's parameter bytes; ``neighbours``: ``_gathered_neighbours(params, prefetch)``."""
    c, sharded = layout.dtype_factor, layout.data_parallel_degree > 1
    extra = 0.0
    if layout.zero_stage >= 2 and sharded:
        # by chunk the .grad are views of (or folded into) the flat buffer; by unit
        # autograd's compute-dtype .grad and the flat buffer exist together; reduced
        # once a step, they fold into the flat buffer (_step_grad_bytes) as they come
        if layout.gather == "chunk":
            copies = layout.grad_factor
        elif layout.reduces_per_microbatch:
            copies = layout.grad_factor + c
        else:  # .grad folded (ZeRO-3's released parameters, an fp32 buffer) or views
            folds = layout.zero_stage == 3 or layout.grad_factor != c
            copies = c if folds else 0.0
        extra += copies * sum(u.grad_bytes for u in groups[g])
    if layout.zero_stage == 3 and (sharded or layout.offload_params):
        extra += c * (params[g] + neighbours[g])
    return extra


def working_set_for_solver(
    units: Sequence[UnitProfile], layout: MemoryLayout
) -> tuple[list[float], float]:
    """The working set as the partition solver takes it: per-unit bytes, and a reserve.

    By chunk it is additive (each unit's own parameters and gradients), so it goes to
    the units and nothing is reserved. By unit or groups it depends on where the
    stage starts; the reserve bounds it for every stage of ``units``: a stage starting
    at ``a`` gathers groups of ``units[a % n:]``'s grouping (or parts of them).
    """
    if layout.gather == "chunk":
        return [zero_working_set_bytes([u], layout) for u in units], 0.0
    n = 1 if layout.gather == "unit" else int(layout.gather)
    offsets = range(min(n, len(units)))
    steps = [_step_grad_bytes(u, layout) for u in units]  # additive: to the units
    reserve = max(
        (zero_working_set_bytes(units[o:], layout) - sum(steps[o:]) for o in offsets),
        default=0.0,
    )
    return steps, reserve


def unit_activation_bytes(unit: UnitProfile, layout: MemoryLayout) -> float:
    """Bytes a unit saves for backward for one microbatch of the layout's size."""
    return unit.activation_bytes * layout.microbatch_scale * layout.dtype_factor


def unit_held_bytes(unit: UnitProfile, layout: MemoryLayout, in_flight: int) -> float:
    """Bytes a unit holds for backward with ``in_flight`` microbatches in flight.

    Each holds what its forward saved (one microbatch's, recomputed, under activation
    checkpointing). Under a split backward (``MemoryLayout.weight_work``) a microbatch whose
    I ran holds what its W keeps instead, which may be more: counted as the larger of
    the two for each microbatch in flight (and, with checkpointing, on top of the one
    recomputed).
    """
    saved = unit_activation_bytes(unit, layout)
    kept = unit.weight_work_bytes * layout.microbatch_scale * layout.dtype_factor
    if not layout.weight_work:
        kept = 0.0
    strategy = block_strategy(layout.activation_checkpointing)
    if strategy is not None:  # the one recomputed: recompute_peak_bytes
        held = min(saved, boundary_bytes(unit, layout))
        if strategy.mode == "selective":
            held = max(held, SELECTIVE_KEPT * saved)
        share = 1.0 / strategy.every  # of the units checkpointed, on average
        return (share * held + (1.0 - share) * max(saved, kept) + share * kept) * in_flight
    if layout.activation_checkpointing:
        return saved + kept * in_flight
    return max(saved, kept) * in_flight


def recompute_peak_bytes(units: Sequence[UnitProfile], layout: MemoryLayout) -> float:
    """Under per-block checkpointing, what a stage of ``units`` adds while it recomputes:
    one block's saved activations at a time, the largest (0 otherwise: chunk
    checkpointing counts the whole chunk's in ``unit_held_bytes``)."""
    strategy = block_strategy(layout.activation_checkpointing)
    if strategy is None:
        return 0.0
    return max((unit_activation_bytes(u, layout) for u in units), default=0.0)


def boundary_bytes(unit: UnitProfile, layout: MemoryLayout) -> float:
    """Bytes of a unit's output at the layout's microbatch size and dtype."""
    return unit.output_bytes * layout.microbatch_scale * layout.dtype_factor


def optimizer_step_bytes(units: Sequence[UnitProfile], layout: MemoryLayout) -> tuple[float, float]:
    """What the optimizer update adds, after the backward (activations gone): the fp32
    copies of the reduced gradients that mixed precision with ``low_precision_grads``
    hands the optimizer (``BucketGrads.opt_grad``, every bucket at once; none with
    offload, whose host gradient is fp32 already, nor with fp32 gradients), and the temporaries of one Adam update on the largest
    optimizer segment (``sqrt`` and ``div`` of the second moment: 2 fp32 copies). A
    segment is a bucket's optimizer range: up to ``bucket_bytes`` of compute-dtype
    elements of one unit group (ZeRO-2/3 by unit or group) or of the stage, ``1/dp`` of
    it at ZeRO >= 1. Returns (copies, temporaries): a rank adds its stages' copies and
    takes the largest temporaries. Without flat buckets (fp32, ZeRO-0, one replica) the
    optimizer updates each parameter: the largest unit bounds its temporaries."""
    trainable = [u.grad_bytes / 4 for u in units]  # fp32 elements
    plain = layout.zero_stage == 0 and not layout.mixed and layout.data_parallel_degree == 1
    if plain:  # no flat buckets (``make_sharded``): the optimizer sees the parameters
        return 0.0, 2 * 4 * max(trainable, default=0.0)  # bounded by the largest unit
    if layout.zero_stage >= 2 and layout.gather != "chunk":
        groups = [sum(u.grad_bytes / 4 for u in g) for g in _gather_groups(units, layout.gather)]
    else:
        groups = [sum(trainable)]
    cap = layout.bucket_bytes / (4 * layout.dtype_factor)  # elements of one bucket
    segment = 4 * min(max(groups, default=0.0), cap) / layout.shards
    copies = 0.0
    if layout.mixed and layout.low_precision_grads and not layout.offloads_optimizer:
        experts = sum(u.expert_grad_bytes for u in units)
        copies = layout.sharded(4 * sum(trainable), experts, layout.shards)
    return copies, 2 * segment


def loss_bytes(last: UnitProfile, layout: MemoryLayout, in_flight: int) -> float:
    """The loss outside the model on the last stage, at its peak (the backward of the
    loss of one microbatch): the fp32 log-probabilities cross-entropy saves for every
    microbatch in flight, plus :func:`loss_backward_bytes`. The same in every
    precision: the last stage's outputs are cast to fp32 for the loss, and neither the
    cast nor the compute-dtype logits outlive the forward."""
    return loss_saved_bytes(last, layout, in_flight) + loss_backward_bytes(last, layout)


def loss_saved_bytes(last: UnitProfile, layout: MemoryLayout, in_flight: int) -> float:
    """The fp32 log-probabilities cross-entropy saves, per microbatch in flight."""
    return last.output_bytes * layout.microbatch_scale * in_flight  # fp32


def loss_backward_bytes(last: UnitProfile, layout: MemoryLayout) -> float:
    """During the loss's backward: the log-probabilities' gradient and the logits', two
    fp32 logits-sized tensors (freed before the last unit's backward runs)."""
    return 2 * last.output_bytes * layout.microbatch_scale  # fp32


@dataclass(frozen=True)
class MessageCounts:
    """The pipeline messages a stage's rank holds at the rank's peak (``mpar.comm._p2p``).

    A send packs the payload into a message buffer that the runtime holds until the
    send completes (``PendingSends`` frees completed sends at every send and receive),
    at the latest when the peer takes it: an activation while its microbatch is in
    flight on the sending stage, a gradient while it is in flight on the stage before.
    A receive is posted early into a buffer of the stream's message size, one per
    incoming stream. Counted from the schedule by
    ``mpar.partition._prediction.message_counts`` at the last moment the rank's
    microbatches in flight peak (transfers between stages on the same rank are handed
    over without a message); bounded by the schedule's in-flight bound, not by the
    number of microbatches.
    """

    sends_forward: int = 1
    """Activation messages sent on to the next stage."""
    sends_backward: int = 1
    """Gradient messages sent back to the previous stage."""
    receives_forward: int = 1
    """Posted receives of the stage's input (0 when the previous stage is local or absent)."""
    receives_backward: int = 1
    """Posted receives of the output's gradient (0 when the next stage is local or absent)."""


def transfer_bytes(inp: float, out: float, transfers: MessageCounts) -> float:
    """Bytes of held send and posted receive buffers for boundaries of ``inp``/``out`` bytes."""
    t = transfers
    return (t.sends_forward + t.receives_backward) * out + (
        t.sends_backward + t.receives_forward
    ) * inp


def stage_extra_bytes(
    units: Sequence[UnitProfile],
    start: int,
    end: int,
    in_flight: int,
    layout: MemoryLayout,
    transfers: MessageCounts | None = None,
) -> float:
    """Bytes of stage ``[start, end)`` beyond states and saved activations.

    Its output kept for backward per microbatch in flight (the input too when
    checkpointing; the last stage keeps no output: the loss holds what it needs),
    pipeline message buffers (``transfers``; default: one of each kind where a
    neighbour exists), the ZeRO-2/3 working set, one gradient bucket under data
    parallelism at ZeRO-0 (the all-reduce's flat buffer; at ZeRO >= 1 the reduction
    reads the gradient buffer itself), at ZeRO-1 under expert parallelism the experts'
    reduced gradient shards (``1/(dp/ep)`` of their gradients, kept beside the whole
    gradients until the step: all of them when ep = dp; measured, the plan_accuracy
    row pp2 x dp2 ep2 ZeRO-1), and the loss when it is the last stage.
    """
    last = end == len(units)
    out = 0.0 if last else boundary_bytes(units[end - 1], layout)
    inp = boundary_bytes(units[start - 1], layout) if start > 0 else 0.0
    kept = out + (inp if layout.activation_checkpointing else 0.0)
    extra = kept * in_flight + transfer_bytes(inp, out, transfers or MessageCounts())
    group = units[start:end]
    working = zero_working_set_bytes(group, layout)
    if layout.data_parallel_degree > 1 and layout.zero_stage == 0:
        grads = sum(u.grad_bytes for u in group) * layout.grad_factor
        extra += min(layout.bucket_bytes, grads)
    if layout.zero_stage == 1:  # the experts' reduced shards beside their whole gradients
        edp = max(layout.data_parallel_degree // layout.expert_parallel_degree, 1)
        extra += sum(u.expert_grad_bytes for u in group) * layout.dtype_factor / edp
    if not last:
        return extra + working
    # the loss's backward comes before the last group's: its temporaries are gone when
    # the group's gradients are copied for the reduction (and at ZeRO-3 the group is
    # gathered for its backward after the loss's: measured, issue 27's ZeRO-3 row)
    loss_moment = loss_backward_bytes(units[-1], layout)
    return extra + loss_saved_bytes(units[-1], layout, in_flight) + max(working, loss_moment)
