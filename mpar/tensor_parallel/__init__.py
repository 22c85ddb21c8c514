"""Tensor parallelism: plans (which module is split how) and applying them to a model.

See ``docs/tensor_parallel.md``. The collectives are operators in ``mpar.comm._tp_ops``;
sequence parallelism (``optimize: "memory"``) is in ``_sequence``.
"""

from mpar.tensor_parallel._apply import HEAD_ATTRS, TPLayout, TPShard, apply_layout, plan_layout
from mpar.tensor_parallel._loss import vocab_parallel_cross_entropy
from mpar.tensor_parallel._sequence import (
    SequenceLayout,
    SequenceParallelError,
    sequence_parallel_on,
)
from mpar.tensor_parallel._tp_plan import (
    FAMILY_PLANS,
    STYLES,
    USER_PLAN,
    Style,
    TPPlanError,
    check_every_pattern,
    match_plan,
    parse_style,
    resolve_plan,
)
from mpar.tensor_parallel._tp_splits import ExampleInputs, measure_tp_splits, tp_splits

__all__ = [
    "ExampleInputs",
    "FAMILY_PLANS",
    "HEAD_ATTRS",
    "STYLES",
    "SequenceLayout",
    "SequenceParallelError",
    "Style",
    "TPLayout",
    "TPPlanError",
    "TPShard",
    "USER_PLAN",
    "apply_layout",
    "check_every_pattern",
    "match_plan",
    "measure_tp_splits",
    "parse_style",
    "plan_layout",
    "resolve_plan",
    "tp_splits",
    "vocab_parallel_cross_entropy",
    "sequence_parallel_on",
]
