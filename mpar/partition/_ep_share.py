"""Expert parallelism in the plan: one ep rank's share of a profile (pure, no torch).

The profile is of the whole model, every expert on every rank, as the runtime
profiles it before the experts are split. :class:`EPSplits` says, per unit, what its
experts weigh and how many rows its mixture-of-experts layers route per microbatch
(measured once by ``mpar.expert_parallel.measure_ep_splits``; it does not depend on
the degree), and :func:`ep_share` turns the profile into one ep rank's at degree
``ep``:

* parameters, gradients and optimizer state: the experts' count ``1/ep`` (a rank
  keeps ``E/ep`` of them); ``UnitProfile.expert_param_bytes`` / ``expert_grad_bytes``
  carry the rank's experts, which ZeRO shards over the expert-data-parallel group
  (``dp/ep`` ranks, ``mpar.partition._memory_model``): at ZeRO >= 1 a rank holds
  ``1/dp`` of every expert's state as before, and gathers only its ``E/ep`` experts;
* compute: unchanged on average (each rank's experts see ``T k`` rows per microbatch
  when routing is even, as one rank's ``T`` tokens did), and activations likewise;
* the all-to-all (``UnitProfile.ep_comm_bytes``, bytes one rank sends per microbatch,
  forward and backward; docs/expert_parallel.md): ``(P_out + P_in)(2 H b + w)``
  with ``P_out = P_in = T k (ep - 1)/ep`` (even routing), plus ``(ep - 1) E/ep`` 8-byte
  counts per layer; seconds are bytes over ``CostModel.ep_bandwidth``, not overlapped
  with compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpar.errors import PartitionError

if TYPE_CHECKING:
    from mpar.profile import ModelProfile, UnitProfile

__all__ = ["EPSplits", "UnitExperts", "ep_comm_s", "ep_share"]


@dataclass(frozen=True)
class UnitExperts:
    """One unit's experts and routed rows, at the profiled microbatch (fp32 bytes)."""

    param_count: int = 0
    """Elements of the unit's expert parameters (every expert)."""
    param_bytes: int = 0
    grad_bytes: int = 0
    """Of those, the trainable ones (gradients and optimizer state follow them)."""
    row_bytes: int = 0
    """Hidden-state bytes of the (token, expert) pairs its MoE layers route per
    microbatch: ``sum over layers of T k H 4``."""
    pairs: int = 0
    """(token, expert) pairs routed per microbatch, over its MoE layers."""
    layers: int = 0
    """MoE layers run per microbatch."""
    num_experts: int = 0
    """Experts of each of its MoE layers (the same in every layer)."""


@dataclass(frozen=True)
class EPSplits:
    """A model's experts, measured: per unit what expert parallelism splits."""

    units: Mapping[str, UnitExperts] = field(default_factory=dict)
    experts: tuple[int, ...] = ()
    """Experts of each MoE layer of the model (every ep degree must divide them)."""
    source: str = ""

    def degrees(self, dp: int) -> list[int]:
        """The ep degrees this model runs at with ``dp`` data-parallel ranks."""
        return [
            e for e in range(1, dp + 1) if dp % e == 0 and all(n % e == 0 for n in self.experts)
        ]

    def check(self, ep: int, dp: int) -> None:
        """Raise when the model cannot run at ep degree ``ep`` on ``dp`` ranks."""
        if ep == 1:
            return
        if not self.experts:
            raise PartitionError(
                f"expert_parallel_degree {ep} cannot be planned: the model has no experts "
                f"module ({self.source or 'none found'})"
            )
        if ep not in self.degrees(dp):
            raise PartitionError(
                f"expert_parallel_degree {ep} cannot be planned with {dp} data-parallel ranks "
                f"and {sorted(set(self.experts))} experts per layer (degrees that fit: "
                f"{self.degrees(dp)})"
            )


def ep_comm_s(unit: UnitProfile, scale: float, bandwidth: float | None) -> float:
    """Seconds of ``unit``'s all-to-alls per microbatch of ``scale`` x the profiled
    bytes; 0 without a bandwidth."""
    if bandwidth is None or not unit.ep_comm_bytes:
        return 0.0
    return unit.ep_comm_bytes * scale / bandwidth


def _less(whole: float, part: float, ep: int) -> float:
    """``whole`` with its ``part`` divided by ``ep``."""
    return whole - part + part / ep


def _unit_share(unit: UnitProfile, e: UnitExperts, ep: int) -> UnitProfile:
    if e.param_bytes > unit.param_bytes:
        raise PartitionError(
            f"unit {unit.name}: {e.param_bytes} expert parameter bytes but the profile has "
            f"{unit.param_bytes}; measure the experts on the profiled model"
        )
    optim = unit.optimizer_bytes * (e.grad_bytes / unit.grad_bytes if unit.grad_bytes else 0.0)
    away = (ep - 1) / ep
    weights = 4 * e.pairs  # one fp32 routing weight per pair
    rows = 2 * away * (2 * e.row_bytes + weights)  # out and in, forward and backward
    counts = e.layers * (ep - 1) * (e.num_experts // ep) * 8
    return dataclasses.replace(
        unit,
        param_count=int(_less(unit.param_count, e.param_count, ep)),
        param_bytes=int(_less(unit.param_bytes, e.param_bytes, ep)),
        grad_bytes=int(_less(unit.grad_bytes, e.grad_bytes, ep)),
        optimizer_bytes=int(_less(unit.optimizer_bytes, optim, ep)),
        expert_param_bytes=e.param_bytes // ep,
        expert_grad_bytes=e.grad_bytes // ep,
        ep_comm_bytes=int(rows + counts),
    )


def ep_share(profile: ModelProfile, splits: EPSplits, ep: int, dp: int) -> ModelProfile:
    """The profile of one ep rank at degree ``ep`` with ``dp`` data-parallel ranks (see the
    module docs); ``profile`` itself at ``ep = 1``. Raises ``PartitionError`` for a degree
    the model cannot take."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise PartitionError(f"expert_parallel_degree must be a positive integer, got {ep!r}")
    splits.check(ep, dp)
    if ep == 1:
        return profile
    units = [_unit_share(u, splits.units.get(u.name, UnitExperts()), ep) for u in profile.units]
    experts = sum(e.param_count for e in splits.units.values())
    count = int(_less(profile.param_count, experts, ep))
    return dataclasses.replace(profile, units=units, param_count=count)
