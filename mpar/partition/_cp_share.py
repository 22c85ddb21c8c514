"""Context parallelism in the plan: one CP rank's share of a profile (pure, no torch).

The profile is of the whole model on whole sequences, as the runtime profiles it.
:class:`CPAttention` says where the model attends and at which sizes (measured once by
``mpar.partition._cp_measure.measure_attention``; it does not depend on the degree),
and :func:`cp_share` turns the profile into the profile of *one* CP rank at degree
``cp`` (after ``tp_share``: of one TP rank of one CP rank), which the rest of the
planner lays out as it does any profile:

* what grows with the sequence divides by ``cp``: the activations a unit saves for
  backward, its outputs (the pipeline messages and the loss's logits), what a split
  backward keeps for W, the TP collectives' bytes, and the per-sample part of the
  unit's time and FLOPs (head-tail chunks give every rank the same causal work);
* parameters, gradients and optimizer state are whole on every CP rank; ZeRO shards
  them, and the gradients are reduced, over dp x cp (``PlanInputs.memory_layout``
  counts ``dp * cp`` replicas);
* attention traffic per microbatch, per rank (``UnitProfile.cp_comm_bytes``, in the
  compute dtype, and ``cp_comm_fp32_bytes``, in float32), by the formula of
  ``docs/context_parallel.md`` for ``T`` tokens (samples x sequence), ``Hq`` query and
  ``Hkv`` key/value heads of ``D`` features per TP rank:

  - ring: forward ``(cp - 1)/cp * 2 T Hkv D`` elements of K and V, the backward the
    same again, plus dK and dV in float32 going round ``cp`` times: ``2 T Hkv D``;
  - all-to-all: ``(cp - 1)/cp^2 * T D (2 Hq + 2 Hkv')`` elements forward and the same
    backward (``Hkv'`` = ``Hkv`` where it divides by ``cp``, else ``Hq``).

  Seconds are bytes over ``CostModel.cp_bandwidth``, added to the unit's time (not
  overlapped with compute: an upper bound for the ring, whose transfers overlap its
  blocks).

Not modelled: one attention layer's transient buffers (the K/V being received, the
block outputs: one layer's K and V of the rank's tokens) and the labels all-gathered
for a causal LM's loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mpar.errors import PartitionError

if TYPE_CHECKING:
    from mpar.profile import ModelProfile, UnitProfile

__all__ = [
    "CP_METHODS",
    "AttentionCall",
    "CPAttention",
    "CPMethod",
    "cp_comm_s",
    "cp_refusal",
    "cp_share",
]

CPMethod = Literal["ring", "all_to_all"]
CP_METHODS: tuple[CPMethod, ...] = ("ring", "all_to_all")


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the profiled microbatch (the whole model, whole sequences)."""

    tokens: int
    """Samples x sequence length of the call's queries."""
    head_dim: int
    q_heads: int
    kv_heads: int
    """Key/value heads before any repetition for grouped-query attention."""


@dataclass(frozen=True)
class CPAttention:
    """Where a model attends: per unit its attention calls, and the sequence length."""

    calls: Mapping[str, tuple[AttentionCall, ...]] = field(default_factory=dict)
    sequence: int = 0
    """Tokens per sequence of the profiled microbatch (the axis CP cuts)."""
    profiled_cp: int = 1
    """The CP degree the profiled sequences were already cut by: 1 for a profile of
    whole sequences (``mpar plan``, the ``"auto"`` search), ``cp`` for the runtime's
    partition, which profiles one CP rank's tokens. :func:`cp_share` divides what
    remains and counts the traffic of the whole sequence."""

    @property
    def found(self) -> bool:
        return any(self.calls.values())


def cp_refusal(attention: CPAttention | None, cp: int, method: str, tp: int = 1) -> str | None:
    """Why degree ``cp`` cannot split this model's sequences (None: it can)."""
    if cp == 1:
        return None
    if attention is None or not attention.found:
        return "no attention mpar can find (scaled_dot_product_attention or Hugging Face's)"
    whole = attention.sequence * attention.profiled_cp
    if whole % (2 * cp):
        return f"the sequence length {whole} does not divide by 2 x cp = {2 * cp}"
    if cp % attention.profiled_cp:
        return f"the profile is of sequences cut by cp {attention.profiled_cp}, not a divisor"
    if method == "all_to_all":
        heads = {c.q_heads // tp for calls in attention.calls.values() for c in calls}
        bad = sorted(h for h in heads if h % cp)
        if bad:
            return f"{bad[0]} query heads per TP rank do not divide by cp {cp} (all_to_all)"
    return None


def _call_bytes(
    call: AttentionCall, cp: int, method: str, tp: int, profiled_cp: int = 1
) -> tuple[float, float]:
    """(compute-dtype, float32) bytes one rank sends for ``call`` per microbatch, at the
    profile's 4 bytes an element."""
    hq, hkv = call.q_heads // tp, max(call.kv_heads // tp, 1)
    per_head = 4.0 * call.tokens * profiled_cp * call.head_dim  # one head, whole sequences
    if method == "ring":
        kv = 2 * hkv * per_head
        return 2 * (cp - 1) / cp * kv, kv
    hkv_moved = hkv if hkv % cp == 0 else hq
    one_way = (cp - 1) / cp**2 * per_head * (2 * hq + 2 * hkv_moved)
    return 2 * one_way, 0.0


def _unit_share(
    unit: UnitProfile, calls: tuple[AttentionCall, ...], cp: int, method: str, tp: int, done: int
) -> UnitProfile:
    moved = [_call_bytes(c, cp, method, tp, done) for c in calls]
    k = cp // done  # what is left to divide of a profile of sequences cut by ``done``
    return dataclasses.replace(
        unit,
        flops=unit.flops // k,
        time_s=unit.fixed_time_s + (unit.time_s - unit.fixed_time_s) / k,
        activation_bytes=unit.activation_bytes // k,
        output_bytes=unit.output_bytes // k,
        weight_work_bytes=unit.weight_work_bytes // k,
        tp_comm_bytes=unit.tp_comm_bytes // k,
        cp_comm_bytes=int(sum(m for m, _ in moved)),
        cp_comm_fp32_bytes=int(sum(g for _, g in moved)),
    )


def cp_share(
    profile: ModelProfile,
    attention: CPAttention | None,
    cp: int,
    method: str = "ring",
    tp: int = 1,
) -> ModelProfile:
    """The profile of one CP rank at degree ``cp`` (see the module docs); ``profile``
    itself at ``cp = 1``. ``profile`` may be one TP rank's already (``tp``: its degree,
    for the heads each rank attends with). Raises ``PartitionError`` where ``cp``
    cannot split the model (``cp_refusal``)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PartitionError(f"context_parallel_degree must be a positive integer, got {cp!r}")
    if method not in CP_METHODS:
        raise PartitionError(
            f"context_parallel_method must be one of {', '.join(CP_METHODS)}, got {method!r}"
        )
    why = cp_refusal(attention, cp, method, tp)
    if why is not None:
        raise PartitionError(f"context_parallel_degree {cp} cannot be planned: {why}")
    if cp == 1 or attention is None:
        return profile
    done = attention.profiled_cp
    units = [_unit_share(u, tuple(attention.calls.get(u.name, ())), cp, method, tp, done) for u in profile.units]  # fmt: skip
    return dataclasses.replace(profile, units=units)


def cp_comm_s(
    unit: UnitProfile, scale: float, dtype_factor: float, bandwidth: float | None
) -> float:
    """Seconds of ``unit``'s attention traffic per microbatch of ``scale`` x the profiled
    samples (``dtype_factor``: compute-dtype bytes over fp32); 0 without a bandwidth."""
    if bandwidth is None or not (unit.cp_comm_bytes or unit.cp_comm_fp32_bytes):
        return 0.0
    return (unit.cp_comm_bytes * dtype_factor + unit.cp_comm_fp32_bytes) * scale / bandwidth
