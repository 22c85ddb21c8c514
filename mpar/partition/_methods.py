"""Simple partition methods: equal units and equal parameter counts."""

from __future__ import annotations

from collections.abc import Sequence

from mpar.errors import PartitionError
from mpar.partition._solver import solve

__all__ = ["parameter_boundaries", "uniform_boundaries"]


def uniform_boundaries(num_units: int, num_stages: int) -> list[int]:
    """Stage starts giving every stage the same number of units (first stages get the extra)."""
    if num_stages < 1 or num_units < num_stages:
        raise PartitionError(f"cannot split {num_units} units into {num_stages} non-empty stages")
    base, extra = divmod(num_units, num_stages)
    starts, pos = [], 0
    for stage in range(num_stages):
        starts.append(pos)
        pos += base + (1 if stage < extra else 0)
    return starts


def parameter_boundaries(param_counts: Sequence[int], num_stages: int) -> list[int]:
    """Stage starts minimising the largest per-stage parameter count (DeepSpeed's "parameters")."""
    return solve([float(c) for c in param_counts], num_stages)
