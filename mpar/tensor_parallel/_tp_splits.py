"""What a model's tensor-parallel plan splits in each unit, for the planner: one function
for the runtime, ``mpar plan --tp`` and the ``"auto"`` search.

:func:`measure_tp_splits` measures a checked layout on the whole model (one forward:
on fake tensors for a profile taken in meta mode, as the profile was). The runtime
calls it with the layout ``DistributedModel`` checked; :func:`tp_splits`, for
``mpar plan``, first resolves the plan the runtime would use and checks it at each
degree asked for, as ``DistributedModel`` checks it when the model is wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mpar.partition._tp_measure import measure_splits
from mpar.partition._tp_share import TPSplits
from mpar.tensor_parallel._apply import TPLayout, plan_layout
from mpar.tensor_parallel._tp_plan import TPPlanError, resolve_plan

if TYPE_CHECKING:
    from torch import nn

    from mpar.profile import ModelProfile

__all__ = ["ExampleInputs", "measure_tp_splits", "tp_splits"]

ExampleInputs = tuple[Sequence[object], Mapping[str, object]]
"""One microbatch as (positional arguments, keyword arguments)."""


def measure_tp_splits(
    module: nn.Module,
    profile: ModelProfile,
    layout: TPLayout,
    inputs: ExampleInputs,
    *,
    degrees: Sequence[int] = (),
    refused: Mapping[int, str] | None = None,
) -> TPSplits:
    """``TPSplits`` of the whole ``module`` under ``layout`` for its ``profile``: split
    parameters (exact, from ``layout.shards``), and from one forward of the whole model
    (on fake tensors when the profile was taken in meta mode) the activations saved in
    split regions and the TP collectives' bytes. ``degrees``: the degrees the plan
    accepts (default 1 and ``layout.size``); ``refused``: why others were refused."""
    args, kwargs = inputs
    units = measure_splits(
        module, profile.units, layout.modules, layout.shards, args, kwargs,
        optimizer=profile.optimizer, fake=profile.mode == "meta",
    )  # fmt: skip
    accepted = tuple(degrees) or (1, layout.size)
    return TPSplits(units, accepted, dict(refused or {}), layout.source)


def tp_splits(
    module: nn.Module,
    profile: ModelProfile,
    inputs: ExampleInputs,
    degrees: Sequence[int],
    *,
    user_plan: Mapping[str, str] | None = None,
    required: int | None = None,
) -> TPSplits:
    """The model's TP plan checked at ``degrees`` (> 1) and measured on ``inputs``.

    A model without a plan gets ``TPSplits.none`` (tp = 1 only). ``required``: a degree
    the caller must have (``--tp``); its refusal, or a missing plan, raises the
    ``TPPlanError`` the runtime would raise when the model is wrapped.
    """
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
    return measure_tp_splits(module, profile, layout, inputs, degrees=accepted, refused=refused)
