"""The per-rank peak memory model and the time knobs of a layout (pure, no torch).

A :class:`Layout` names everything besides the partition that changes what a
rank holds: data-parallel degree and ZeRO stage, offload, precision,
activation checkpointing and the microbatch size relative to the profiled one.
The functions here turn a profile's per-unit figures into device bytes at the
*peak* of a step, following what the runtime allocates:

* parameters in the compute dtype (2 bytes an element under bf16/fp16); ZeRO-3
  keeps a ``1/dp`` shard (on the host with ``offload_params``) and gathers a
  whole chunk's parameters while it runs, so its peak holds shard + full chunk;
* gradients: a full-size buffer in the compute dtype from a stage's first
  backward to its once-per-step reduction, at every ZeRO stage (microbatches
  accumulate into it; ZeRO-2 shards what survives the reduction only);
* optimizer state (and the fp32 master copy under mixed precision) divided by
  ``dp`` at ZeRO >= 1, nothing on the device with ``offload_optimizer``;
* activations saved for backward per microbatch in flight, plus the stage's
  output kept for its backward; with activation checkpointing only the stage's
  input and output per microbatch in flight, plus one microbatch's full
  activations while it is recomputed;
* the last stage's loss: the log-softmax of the logits (fp32) per microbatch in
  flight, the logits' gradient, and under mixed precision their fp32 copy;
* communication: one boundary activation received and one sent per stage, and
  one gradient bucket when ``dp > 1``.

Profiles are taken in fp32 at one microbatch size; activations, outputs and
time scale linearly with ``microbatch_scale`` (samples per microbatch over the
profiled samples), an approximation that ignores fixed per-call costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpar.errors import PartitionError

if TYPE_CHECKING:
    from mpar.profile import UnitProfile

__all__ = ["Layout", "loss_bytes", "stage_extra_bytes", "unit_activation_bytes", "unit_state_bytes"]

_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Layout:
    """The memory- and time-relevant knobs of one layout, apart from the partition."""

    data_parallel_degree: int = 1
    zero_stage: int = 0
    precision: str = "fp32"
    """"fp32", or "bf16" / "fp16" mixed precision (compute dtype, fp32 master weights)."""
    activation_checkpointing: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    microbatch_scale: float = 1.0
    """Samples per microbatch divided by the samples of the profiled microbatch."""
    bucket_bytes: int = 25 * 2**20
    """One gradient-reduction bucket (``zero.bucket_mb``)."""

    def __post_init__(self) -> None:
        if self.data_parallel_degree < 1:
            raise PartitionError(
                f"data_parallel_degree must be >= 1, got {self.data_parallel_degree}"
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

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def dtype_factor(self) -> float:
        """Compute-dtype bytes relative to the fp32 profile."""
        return 0.5 if self.mixed else 1.0

    @property
    def shards(self) -> int:
        """How many ways optimizer state is split."""
        return self.data_parallel_degree if self.zero_stage >= 1 else 1


def unit_state_bytes(unit: UnitProfile, layout: Layout) -> float:
    """Device bytes of a unit's parameters, gradients and optimizer state at the step's peak."""
    c, dp = layout.dtype_factor, layout.data_parallel_degree
    params = c * unit.param_bytes
    if layout.zero_stage == 3:
        shard = 0.0 if layout.offload_params else params / dp
        params += shard  # the gathered chunk plus this rank's shard
    grads = c * unit.grad_bytes
    optim = 0.0
    if not layout.offload_optimizer:
        master = unit.grad_bytes if layout.mixed else 0  # fp32 copy of trainable parameters
        optim = (unit.optimizer_bytes + master) / layout.shards
    return params + grads + optim


def unit_activation_bytes(unit: UnitProfile, layout: Layout) -> float:
    """Bytes a unit saves for backward for one microbatch of the layout's size."""
    return unit.activation_bytes * layout.microbatch_scale * layout.dtype_factor


def boundary_bytes(unit: UnitProfile, layout: Layout) -> float:
    """Bytes of a unit's output at the layout's microbatch size and dtype."""
    return unit.output_bytes * layout.microbatch_scale * layout.dtype_factor


def loss_bytes(last: UnitProfile, layout: Layout, in_flight: int) -> float:
    """The loss outside the model on the last stage: fp32 log-softmax of the logits per
    microbatch in flight, the logits' gradient, and their fp32 copy under mixed precision."""
    logits = last.output_bytes * layout.microbatch_scale  # fp32
    return logits * (in_flight + 1 + (1 if layout.mixed else 0))


def stage_extra_bytes(
    units: Sequence[UnitProfile], start: int, end: int, in_flight: int, layout: Layout
) -> float:
    """Bytes of stage ``[start, end)`` beyond states and saved activations.

    Its output kept for backward per microbatch in flight (the input too when
    checkpointing), one received and one sent boundary tensor, one gradient
    bucket under data parallelism, and the loss when it is the last stage.
    """
    out = boundary_bytes(units[end - 1], layout)
    inp = boundary_bytes(units[start - 1], layout) if start > 0 else 0.0
    kept = out + (inp if layout.activation_checkpointing else 0.0)
    extra = kept * in_flight + inp + out
    if layout.data_parallel_degree > 1:
        grads = sum(u.grad_bytes for u in units[start:end]) * layout.dtype_factor
        extra += min(layout.bucket_bytes, grads)
    if end == len(units):
        extra += loss_bytes(units[-1], layout, in_flight)
    return extra
