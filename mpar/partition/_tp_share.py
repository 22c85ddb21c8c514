"""Tensor parallelism in the plan: one TP rank's share of a profile (pure, no torch).

The profile is of the whole (unsplit) model, as the runtime profiles it before the
TP transform. :class:`TPSplits` says, per unit, what a TP plan splits (measured once
by ``mpar.partition._tp_measure.measure_splits``; it does not depend on the degree),
and :func:`tp_share` turns the profile into the profile of *one* TP rank at degree
``tp``, which the rest of the planner lays out and shards over dp as it does any
profile:

* parameters, gradients and optimizer state: split parameters count ``1/tp``,
  replicated ones (norms, embeddings left whole, rowwise biases) whole. Exact: the
  split parameters are those of ``plan_layout``'s ``layout.shards``;
* saved activations: what a unit saves *inside* a split region (after a colwise
  module's forward, up to the end of the next rowwise module's) counts ``1/tp``,
  the rest whole (the input of a colwise module and the output of a rowwise module
  are whole on every rank). An approximation: the region is measured on the whole
  model in execution order, and a tensor saved there is taken to be split;
* time: the unit's compute times ``(1 - f) + f / tp``, ``f`` the split share of its
  parameter bytes (matmul work follows the weights; attention inside a split block
  splits with its heads), plus its TP communication;
* TP communication per microbatch (``UnitProfile.tp_comm_bytes``, bytes one rank
  sends): ring collectives over the TP group. A rowwise module all-reduces its
  output in the forward, a colwise module its input's gradient in the backward (one
  each, as mpar's operators run them: q, k and v are three), ``colwise_rep``
  all-gathers its output and ``rowwise_rep`` its input's gradient. A ring all-reduce
  of ``S`` bytes sends ``2 (tp - 1) / tp * S`` per rank, an all-gather of a whole
  ``S`` sends ``(tp - 1) / tp * S``; seconds are bytes over ``CostModel.tp_bandwidth``,
  not overlapped with compute (``mpar.partition._planner`` adds them to the unit's time).

Pipeline boundary tensors stay whole (each TP rank sends the whole tensor to its
peer in the next stage), so ``output_bytes`` is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpar.errors import PartitionError

if TYPE_CHECKING:
    from mpar.profile import ModelProfile, UnitProfile

__all__ = ["NO_PLAN", "TPSplits", "UnitSplit", "tp_comm_s", "tp_share"]

NO_PLAN = "the model has no tensor-parallel plan"


@dataclass(frozen=True)
class UnitSplit:
    """What a TP plan splits in one unit, at the profiled microbatch (fp32 bytes)."""

    param_count: int = 0
    """Elements of the unit's own parameters that are split."""
    param_bytes: int = 0
    """Bytes of the unit's own parameters that are split."""
    grad_bytes: int = 0
    """Of those, the trainable ones (gradients and optimizer state follow them)."""
    tied_state_bytes: dict[str, int] = field(default_factory=dict)
    """Split parameters the unit uses but an earlier unit owns: owner -> state bytes."""
    saved_split: float = 0.0
    """Share of the activations the unit saves for backward that are split (0 to 1)."""
    allreduce_bytes: int = 0
    """Bytes all-reduced over the TP group per microbatch (forward and backward)."""
    gather_bytes: int = 0
    """Whole bytes all-gathered over the TP group per microbatch."""


@dataclass(frozen=True)
class TPSplits:
    """A model's TP plan, measured: per unit what it splits, and the degrees it accepts."""

    units: Mapping[str, UnitSplit]
    degrees: tuple[int, ...]
    """TP degrees the plan can be applied at (``plan_layout`` succeeded), 1 included."""
    refused: Mapping[int, str] = field(default_factory=dict)
    """Degree -> why the plan cannot be applied at it (heads or sizes not divisible)."""
    source: str = ""
    """Where the plan came from (the config's ``tp_plan``, the model's own, mpar's)."""

    @classmethod
    def none(cls, reason: str = NO_PLAN) -> TPSplits:
        """A model without a plan: only ``tp = 1``."""
        return cls({}, (1,), {}, reason)

    def check(self, tp: int) -> None:
        """Raise when the plan cannot be applied at degree ``tp``."""
        if tp == 1 or tp in self.degrees:
            return
        why = self.refused.get(tp) or self.source or NO_PLAN
        raise PartitionError(
            f"tensor_parallel_degree {tp} cannot be planned: {why} (degrees the plan "
            f"accepts: {list(self.degrees)})"
        )


def tp_comm_s(unit: UnitProfile, scale: float, bandwidth: float | None) -> float:
    """Seconds of ``unit``'s TP collectives per microbatch of ``scale`` x the profiled
    bytes (microbatch scale times the dtype factor); 0 without a bandwidth."""
    if bandwidth is None or not unit.tp_comm_bytes:
        return 0.0
    return unit.tp_comm_bytes * scale / bandwidth


def _share(whole: float, split: float, tp: int) -> float:
    return whole - split + split / tp


def _unit_share(unit: UnitProfile, s: UnitSplit, tp: int) -> UnitProfile:
    if unit.param_bytes and s.param_bytes > unit.param_bytes:
        raise PartitionError(
            f"unit {unit.name}: {s.param_bytes} split parameter bytes but the profile has "
            f"{unit.param_bytes}; measure the splits on the profiled model"
        )
    grad_share = s.grad_bytes / unit.grad_bytes if unit.grad_bytes else 0.0
    param_share = s.param_bytes / unit.param_bytes if unit.param_bytes else 0.0
    tied = {
        owner: int(_share(nbytes, s.tied_state_bytes.get(owner, 0), tp))
        for owner, nbytes in unit.tied_state_bytes.items()
    }
    ring = (tp - 1) / tp
    return dataclasses.replace(
        unit,
        param_count=int(_share(unit.param_count, s.param_count, tp)),
        param_bytes=int(_share(unit.param_bytes, s.param_bytes, tp)),
        grad_bytes=int(_share(unit.grad_bytes, s.grad_bytes, tp)),
        optimizer_bytes=int(_share(unit.optimizer_bytes, unit.optimizer_bytes * grad_share, tp)),
        flops=int(_share(unit.flops, unit.flops * param_share, tp)),
        time_s=_share(unit.time_s, (unit.time_s - unit.fixed_time_s) * param_share, tp),
        activation_bytes=int(
            _share(unit.activation_bytes, unit.activation_bytes * s.saved_split, tp)
        ),
        tied_state_bytes=tied,
        tp_comm_bytes=int(ring * (2 * s.allreduce_bytes + s.gather_bytes)),
    )


def tp_share(profile: ModelProfile, splits: TPSplits, tp: int) -> ModelProfile:
    """The profile of one TP rank at degree ``tp`` (see the module docs); ``profile``
    itself at ``tp = 1``. Raises ``PartitionError`` for a degree the plan refuses."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PartitionError(f"tensor_parallel_degree must be a positive integer, got {tp!r}")
    splits.check(tp)
    if tp == 1:
        return profile
    units = [_unit_share(u, splits.units.get(u.name, UnitSplit()), tp) for u in profile.units]
    split = sum(s.param_count for s in splits.units.values())
    count = int(_share(profile.param_count, split, tp))
    return dataclasses.replace(profile, units=units, param_count=count)
