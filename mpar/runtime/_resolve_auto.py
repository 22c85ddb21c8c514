"""Resolving "auto" config values at the first step, from a profile (rank 0 decides).

``microbatches``, ``virtual_stages``, ``zero.stage`` and
``activation_checkpointing`` may be "auto" (``device_memory`` set). At the
first step, before the batch is split, rank 0 profiles the model on this
replica's whole batch, runs ``mpar.partition.search`` with the other keys
fixed to their configured values (``mpar.partition.space_around`` of the run's
``PlanInputs``, the record the partition plans for: the grid included), logs the
choice on stderr and broadcasts it; every rank then runs the model with the
resolved config (``model.config`` shows it; ``mpar.config()`` keeps what
``mpar.init`` was given).

Under tensor parallelism the search keeps the configured degree and lays out one TP
rank's share of the profile (``mpar.partition._tp_share``), read from the model's checked
TP layout as the partition reads it (``mpar.tensor_parallel.measure_tp_splits``).
Under context parallelism it keeps the configured degree and lays out one CP rank's
share (``mpar.partition._cp_share``) of the profile of whole sequences, with the
attention found in it (``mpar.context_parallel.measure_cp_attention``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mpar import _device
from mpar.comm import State
from mpar.comm._collectives import broadcast_object_world
from mpar.config import Config
from mpar.errors import StepError
from mpar.runtime._microbatch import split_microbatches

if TYPE_CHECKING:
    from mpar.runtime._model import DistributedModel

__all__ = ["resolve_auto"]


def _choose(
    model: DistributedModel, fn: Callable[..., object], whole: Any, st: State
) -> dict[str, Any]:
    """Rank 0: profile on the replica's batch and search; returns the resolved values."""
    from mpar.meta import find_units_meta
    from mpar.partition import find_units, search, space_around
    from mpar.profile import preserved_state, profile_mode, profile_model
    from mpar.runtime._local_stages import cp_attention_of, planner_inputs
    from mpar.tensor_parallel import measure_tp_splits

    cfg = st.config
    if cfg.device_memory is None:  # on CUDA: the device's own memory (the config allows it)
        cfg = dataclasses.replace(cfg, device_memory=_device.total_memory(st.device))
    args, kwargs = model.capture(fn, whole, 0)
    module = model.module
    mode = profile_mode(module, cfg.device_memory)  # meta: nothing runs for real
    if mode == "meta":
        units = find_units_meta(module, args, kwargs)
    else:
        with torch.no_grad(), preserved_state(module):
            units = find_units(module, args, kwargs)
    profile = profile_model(module, args, kwargs, units=units, repeats=1, warmup=1, mode=mode)
    module.zero_grad(set_to_none=True)
    batch = whole.sizes[0]
    layout = model.tp_layout
    splits = None if layout is None else measure_tp_splits(module, profile, layout, (args, kwargs))
    experts = None
    if model.ep_layout is not None:
        from mpar.expert_parallel import measure_ep_splits

        experts = measure_ep_splits(module, profile, (args, kwargs), plan=cfg.ep_plan)
    grid = st.grid.topology  # whole sequences here: the batch is not cut yet
    attention = cp_attention_of(module, profile, (args, kwargs), grid, profiled_cp=1)
    inputs = planner_inputs(cfg, grid, st.device, splits, ep_splits=experts, cp_attention=attention)
    result = search(
        profile,
        inputs,
        global_batch=batch * inputs.grid.dp,
        profile_batch=batch,
        space=space_around(inputs, cfg.auto_keys),
        top=3,
    )
    best = result.best
    return {
        "microbatches": best.microbatches,
        "virtual_stages": best.virtual_stages,
        "zero.stage": best.zero_stage,
        "activation_checkpointing": best.activation_checkpointing,
        "predicted_step_time_s": best.step_time_s,
        "predicted_peak_bytes": best.max_rank_memory_bytes,
    }


def _apply(cfg: Config, chosen: Mapping[str, Any]) -> Config:
    auto = cfg.auto_keys
    zero = cfg.zero
    if "zero.stage" in auto:
        zero = dataclasses.replace(zero, stage=chosen["zero.stage"])
    changes: dict[str, Any] = {k: chosen[k] for k in auto if "." not in k}
    return dataclasses.replace(cfg, zero=zero, auto_keys=(), **changes)


def resolve_auto(
    fn: Callable[..., object],
    model: DistributedModel,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    st: State,
    *,
    non_split_inputs: Sequence[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
) -> Config:
    """``st.config`` with every "auto" key resolved (the same on every rank)."""
    if model.partitioned:
        raise StepError(
            f"config keys {list(st.config.auto_keys)} are 'auto' but the model was already "
            "partitioned from example_inputs; leave example_inputs out so the planner can "
            "resolve them at the first step"
        )
    decision: Any = None
    if st.layout.rank == 0:
        try:
            whole = split_microbatches(
                fn, (model, *args), kwargs, 1,
                non_split_inputs=non_split_inputs, input_split_axes=input_split_axes,
            )  # fmt: skip
            decision = ("ok", _choose(model, fn, whole, st))
        except Exception as exc:  # every rank must learn of the failure, not hang
            decision = ("error", exc)
    decision = broadcast_object_world(decision, st.grid, src=0)
    if decision[0] == "error":
        raise decision[1]
    chosen, auto = decision[1], st.config.auto_keys
    resolved = _apply(st.config, chosen)
    if st.layout.rank == 0:
        shown = {k: chosen[k] for k in auto}
        print(
            f"mpar: 'auto' resolved to {shown} (predicted step "
            f"{chosen['predicted_step_time_s'] * 1e3:.4g} ms, peak "
            f"{chosen['predicted_peak_bytes'] / 2**20:.1f} MiB per rank)",
            file=sys.stderr,
        )
    return resolved
