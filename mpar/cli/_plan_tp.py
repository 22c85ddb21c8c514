"""``mpar plan`` with tensor parallelism: which TP degrees a model's plan accepts, and
what it splits in each unit (``mpar.partition._tp_share``).

The plan is the one the runtime would use (``mpar.tensor_parallel.resolve_plan``: the
config's ``tp_plan``, the model's ``base_model_tp_plan``, mpar's plan for its family),
checked at each degree with ``plan_layout`` exactly as ``DistributedModel`` checks it
when the model is wrapped, then measured once (``measure_splits``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from mpar.partition._tp_share import TPSplits
    from mpar.profile import ModelProfile

__all__ = ["tp_splits"]


def tp_splits(
    module: nn.Module,
    profile: ModelProfile,
    inputs: tuple[Sequence[Any], Mapping[str, Any]],
    degrees: Sequence[int],
    *,
    user_plan: Mapping[str, Any] | None = None,
    required: int | None = None,
) -> TPSplits:
    """The model's TP plan checked at ``degrees`` (> 1) and measured on ``inputs``.

    A model without a plan gets ``TPSplits.none`` (tp = 1 only). ``required``: a degree
    the caller must have (``--tp``); its refusal, or a missing plan, raises the
    ``TPPlanError`` the runtime would raise when the model is wrapped.
    """
    from mpar.partition._tp_measure import measure_splits
    from mpar.partition._tp_share import TPSplits
    from mpar.tensor_parallel import TPPlanError, plan_layout, resolve_plan

    try:
        plan, source = resolve_plan(module, user_plan)
    except TPPlanError:
        if required not in (None, 1):
            raise
        return TPSplits.none(
            f"{type(module).__name__} has no tensor-parallel plan (no tp_plan in the config, "
            "no config.base_model_tp_plan, no mpar plan for its family)"
        )
    accepted, refused, layout = [1], {}, None
    for tp in sorted(set(degrees) - {1}):
        try:
            found = plan_layout(module, plan, tp, source)
        except TPPlanError as exc:
            if tp == required:
                raise
            refused[tp] = str(exc)
            continue
        accepted.append(tp)
        layout = layout or found
    if layout is None:
        return TPSplits({}, tuple(accepted), refused, source)
    args, kwargs = inputs
    units = measure_splits(
        module, profile.units, layout.modules, layout.shards, args, kwargs,
        optimizer=profile.optimizer,
    )  # fmt: skip
    return TPSplits(units, tuple(accepted), refused, source)
