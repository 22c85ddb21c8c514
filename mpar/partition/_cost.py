"""Time knobs of the plan's cost model: links, host transfers, mixed precision (pure).

Times come from the profile (measured, or FLOPs over an assumed rate on the
meta device) and are scaled, per layout, by:

* the microbatch size (linearly, like activations);
* mixed precision: compute divided by ``mixed_speedup`` (default 2: an
  assumption about the accelerator, nothing the CPU runtime measures);
* activation checkpointing: one more forward in every backward
  (``recompute_fraction`` = 1/3 of forward+backward);
* communication between neighbouring stages: ``2 * output_bytes /
  link_bandwidth`` per microbatch (activation forward, gradient back);
* data parallelism, once per step per rank, not overlapped with compute: a ring
  all-reduce of the gradients (ZeRO-0) or its reduce-scatter + all-gather (ZeRO-1/2,
  the same ``2 (dp - 1) / dp`` bytes per byte), and for ZeRO-3 a reduce-scatter of
  the gradients plus an all-gather of each unit's parameters for every forward and
  every backward of every microbatch, or of each chunk at most twice a step when
  gathered by chunk (:func:`zero3_gathers_per_step`);
* tensor parallelism: each unit's TP collectives per microbatch over
  ``tp_bandwidth``, added to its time (``mpar.partition._tp_share``);
* expert parallelism: each unit's expert all-to-alls per microbatch over
  ``ep_bandwidth``, added to its time (``mpar.partition._ep_share``);
* context parallelism: each unit's attention traffic per microbatch over
  ``cp_bandwidth``, added to its time (``mpar.partition._cp_share``);
* offload, over ``host_bandwidth``: gradients to the host and parameters back
  (optimizer offload) plus the host optimizer at ``host_optimizer_rate``
  parameters per second; parameter shards copied in at every gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpar.errors import PartitionError

if TYPE_CHECKING:
    from mpar.partition._memory_model import MemoryLayout
    from mpar.profile import UnitProfile

__all__ = ["CostModel", "step_overhead_s", "zero3_gathers_per_step"]


@dataclass(frozen=True)
class CostModel:
    """Bandwidths and speed factors (bytes per second, parameters per second)."""

    link_bandwidth: float | None = 10e9
    """Between neighbouring pipeline stages; None leaves p2p communication out."""
    dp_bandwidth: float | None = 10e9
    """Per rank in data-parallel collectives; None leaves them out."""
    tp_bandwidth: float | None = 10e9
    """Per rank in tensor-parallel collectives (ring all-reduce and all-gather inside a
    TP group, usually one host's links); None leaves them out (``mpar.partition._tp_share``)."""
    ep_bandwidth: float | None = 10e9
    """Per rank in the expert all-to-alls (between the ranks of an ep group, which are
    data-parallel ranks: often other hosts); None leaves them out
    (``mpar.partition._ep_share``)."""
    cp_bandwidth: float | None = 10e9
    """Per rank in context-parallel attention traffic (the ring's K/V steps or the
    all-to-alls inside a CP group); None leaves it out (``mpar.partition._cp_share``)."""
    host_bandwidth: float = 10e9
    """Device <-> host copies of offloaded state."""
    host_optimizer_rate: float = 1e9
    """Parameters per second the host optimizer updates (offload_optimizer)."""
    mixed_speedup: float = 2.0
    """Compute speed of bf16/fp16 relative to the fp32 profile."""
    recompute_fraction: float = 1 / 3
    """Share of forward+backward time one recomputed forward costs."""
    process_bytes: float = 5 * 2**20
    """Memory every training process holds besides tensors, counted in each rank's peak:
    the framework's kernel workspaces and allocator state after a step. The default is
    what the CPU runtime measures (anonymous RSS at rest minus live tensor bytes: 4.3-4.8
    MiB on every rank of the calibration grid at pp=1, 4.8 MiB in a plain torch training
    loop). On CUDA set it to what the device holds outside your allocator's figure."""
    pipeline_process_bytes: float = 6 * 2**20
    """More per rank of a pipeline (pp > 1): the interpreter objects of the traced and
    split stage graphs (torch.fx nodes with their metadata) and the heap they leave;
    measured 5.5-6.4 MiB on every pipeline rank of the calibration grid (a 6-layer GPT:
    it grows with the traced graph, not with tensor sizes)."""
    moe_pipeline_process_bytes: float = 3.5 * 2**20
    """More per rank of a pipeline (pp > 1) for each mixture-of-experts layer of the whole
    model (every rank captures the whole model before it keeps its stages): the routing's
    data-dependent shapes (unbacked sizes, their guards and fake tensors) and the larger
    graphs of torch.export leave objects and heap behind. Measured on the calibration
    grid's pp 2 x dp 2 ep 2 row (4 MoE layers of 8 experts): 24.1-25.1 MiB at rest
    besides tensors on every rank against 7.1-7.9 MiB on the dense pp 2 rows, and 24.4
    against 10.7 MiB in a second script measuring both alike (13.7 MiB: 3.4 per layer);
    neither grows after the first step. Counted where the plan knows the experts
    (``PlanInputs.ep_splits``: at ep > 1, and in ``mpar plan`` for a model with experts)."""
    mixed_process_bytes: float = 12 * 2**20
    """More per rank under bf16/fp16 mixed precision: what the CPU runtime's
    low-precision kernels keep besides tensors (measured on the calibration grid; on
    CUDA give the whole figure with ``process_bytes``)."""

    input_backward_fraction: float = 0.61
    """Under a split-backward schedule (``zero_bubble``, ``zbv``): a stage's I (input
    gradients) as a fraction of its unsplit backward. The first stage, whose inputs need
    no gradient, has no I: its whole backward is its W."""
    weight_backward_fraction: float = 0.42
    """Its W (the deferred weight gradients) as a fraction of the unsplit backward. The
    two fractions sum above 1 by what the split itself costs; measured on the CPU runtime
    (``benchmarks/split_backward.py``: 4 transformer blocks, an LM head and the loss,
    microbatches of 8 x 32 tokens, one thread): I 0.60-0.62 and W 0.41-0.42 of the
    backward."""
    split_action_s: float = 100e-6
    """Runtime seconds the split adds per stage and microbatch whatever its size (one more
    action, and a hook per deferred linear layer; about 0.1-0.2 ms on the CPU runtime):
    what makes the split pay less with small microbatches."""

    def __post_init__(self) -> None:
        for name in ("host_bandwidth", "host_optimizer_rate", "mixed_speedup"):
            if not getattr(self, name) > 0:
                raise PartitionError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "process_bytes",
            "pipeline_process_bytes",
            "moe_pipeline_process_bytes",
            "mixed_process_bytes",
        ):
            if not getattr(self, name) >= 0:
                raise PartitionError(
                    f"{name} must be >= 0 bytes (0 leaves it out), got {getattr(self, name)!r}"
                )
        for name in (
            "link_bandwidth",
            "dp_bandwidth",
            "tp_bandwidth",
            "ep_bandwidth",
            "cp_bandwidth",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PartitionError(f"{name} must be > 0 or None, got {value!r}")
        for name in ("input_backward_fraction", "weight_backward_fraction", "split_action_s"):
            if not getattr(self, name) >= 0:
                raise PartitionError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.recompute_fraction <= 1:
            raise PartitionError(
                f"recompute_fraction must be in [0, 1], got {self.recompute_fraction!r}"
            )


def zero3_gathers_per_step(microbatches: int, gather: str | int = "unit") -> int:
    """ZeRO-3 all-gathers of each parameter per step, by gather granularity
    (``MemoryLayout.gather``, as ``_memory.zero_working_set_bytes`` models it).

    By unit or group (at most two gathered at once) a stage cannot keep its
    parameters between its actions, so every forward and every backward of every
    microbatch gathers each unit again. By chunk a stage stays gathered from its
    UNSHARD to its RESHARD: once a step, twice where ``reshard_after_forward`` frees
    it between its forward and backward phases (counted: the bound).
    """
    return 2 if gather == "chunk" else 2 * microbatches


def step_overhead_s(
    groups: Sequence[Sequence[UnitProfile]],
    layout: MemoryLayout,
    cost: CostModel,
    *,
    pipeline: str = "interleaved",
    virtual_stages: int = 1,
    microbatches: int = 1,
) -> float:
    """Seconds one rank spends per step on data-parallel sync and offload (its stages' units).

    ``pipeline`` and ``virtual_stages`` are accepted for schedules whose gathers differ;
    ZeRO-3 gathers per action, or per step by chunk (:func:`zero3_gathers_per_step`);
    ZeRO 2/3 reduce-scatter per microbatch by unit with ``reduce: "microbatch"``, else
    once per step (``MemoryLayout.reduces_per_microbatch``).
    """
    units = [u for group in groups for u in group]
    c, dp, z = layout.dtype_factor, layout.data_parallel_degree, layout.zero_stage
    grads = c * sum(u.grad_bytes for u in units)
    params = c * sum(u.param_bytes for u in units)
    gathers = zero3_gathers_per_step(microbatches, layout.gather) if z == 3 else 0
    seconds = 0.0
    if dp > 1 and cost.dp_bandwidth is not None:
        share = (dp - 1) / dp
        # reduce-scatters: once a step, or per microbatch (``zero.reduce``); ZeRO 0-1
        # all-reduce (twice a reduce-scatter's traffic) once a step
        reduced = grads * (microbatches if layout.reduces_per_microbatch else 1)
        moved = share * (reduced + gathers * params) if z >= 2 else 2 * share * grads
        if z == 2:
            moved += share * params  # the updated shards all-gathered after the step
        seconds += moved / cost.dp_bandwidth
    if layout.offload_optimizer:
        shard_grads, shard_params = grads / layout.shards, params / layout.shards
        seconds += (shard_grads + shard_params) / cost.host_bandwidth
        trainable = sum(u.grad_bytes for u in units) / 4 / layout.shards
        seconds += trainable / cost.host_optimizer_rate
    if layout.offload_params:
        seconds += gathers * params / dp / cost.host_bandwidth
    return seconds
