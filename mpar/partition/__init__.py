"""Partitioning: units, the optimal solver, module splitting, manual placement, plans.

``mpar.partition`` is both this package and a public context manager: the
package module is callable, so ``with mpar.partition(1): ...`` places modules
on stage 1 (see ``_manual``) while ``mpar.partition.solve(...)`` reaches the
solver.
"""

from __future__ import annotations

import sys
import types
from contextlib import AbstractContextManager

from mpar._size import parse_bytes
from mpar.partition._cost import CostModel
from mpar.partition._cp_measure import measure_attention
from mpar.partition._cp_share import AttentionCall, CPAttention
from mpar.partition._manual import assigned_stage, manual_boundaries, partition
from mpar.partition._memory_model import MemoryLayout
from mpar.partition._methods import parameter_boundaries, uniform_boundaries
from mpar.partition._plan_inputs import PlanInputs, ScheduleSetup, ZeroSetup, plan_inputs
from mpar.partition._plan_report import Plan, StagePlan
from mpar.partition._planner import make_plan
from mpar.partition._search import (
    CHECKPOINTING,
    HEADROOM,
    Candidate,
    SearchResult,
    SearchSpace,
    fit_fixed_times,
    search,
    space_around,
)
from mpar.partition._solver import (
    memory_weight_for,
    min_memory_for,
    min_stages_for,
    solve,
    stage_costs,
)
from mpar.partition._split import SplitModel, split_module
from mpar.profile._units import find_units, unit_modules

__all__ = [
    "CHECKPOINTING",
    "HEADROOM",
    "AttentionCall",
    "CPAttention",
    "Candidate",
    "CostModel",
    "MemoryLayout",
    "Plan",
    "PlanInputs",
    "ScheduleSetup",
    "SearchResult",
    "SearchSpace",
    "SplitModel",
    "StagePlan",
    "ZeroSetup",
    "assigned_stage",
    "find_units",
    "fit_fixed_times",
    "make_plan",
    "manual_boundaries",
    "measure_attention",
    "memory_weight_for",
    "min_memory_for",
    "min_stages_for",
    "parameter_boundaries",
    "parse_bytes",
    "partition",
    "plan_inputs",
    "search",
    "solve",
    "space_around",
    "split_module",
    "stage_costs",
    "uniform_boundaries",
    "unit_modules",
]


class _CallablePackage(types.ModuleType):
    """Module type whose instances can be called: ``mpar.partition(i)`` → ``partition(i)``."""

    def __call__(self, index: int) -> AbstractContextManager[None]:
        return partition(index)


sys.modules[__name__].__class__ = _CallablePackage
