"""Resolving "auto" config values at the first step, from a profile (rank 0 decides).

``microbatches``, ``virtual_stages``, ``zero.stage`` and
``activation_checkpointing`` may be "auto" (``device_memory`` set). At the
first step, before the batch is split, rank 0 profiles the model on this
replica's whole batch, runs ``mpar.partition.search`` with the other keys
fixed to their configured values, logs the choice on stderr and broadcasts it;
every rank then runs the model with the resolved config (``model.config`` shows
it; ``mpar.config()`` keeps what ``mpar.init`` was given).

Under tensor parallelism the search keeps the configured degree and lays out one TP
rank's share of the profile (``mpar.partition._tp_share``), read from the model's checked
TP layout as the partition reads it (``mpar.runtime._local_stages.tp_splits_of``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mpar.comm import State
from mpar.comm._collectives import broadcast_object_world
from mpar.config import Config
from mpar.errors import StepError
from mpar.runtime._microbatch import split_microbatches

if TYPE_CHECKING:
    from mpar.partition import SearchSpace
    from mpar.runtime._model import DistributedModel

__all__ = ["resolve_auto"]


def _space(cfg: Config, auto: Sequence[str], tp: int = 1) -> SearchSpace:
    from mpar.partition import SearchSpace

    zero = cfg.zero
    offload = (zero.offload_optimizer == "cpu", zero.offload_params == "cpu")
    if "zero.stage" not in auto:
        stages: tuple[int, ...] = (zero.stage,)
    else:
        stages = (3,) if offload[1] else (1, 2, 3) if offload[0] else (0, 1, 2, 3)
    checkpointing = cfg.activation_checkpointing not in (False, "none")
    precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"
    return SearchSpace(
        pipelines=(cfg.pipeline,),
        zero_stages=stages,
        offload_choices=(offload,),
        checkpointing=(False, True) if "activation_checkpointing" in auto else (checkpointing,),
        precisions=(precision,),
        virtual_stage_choices=None if "virtual_stages" in auto else (cfg.virtual_stages,),
        microbatch_choices=None if "microbatches" in auto else (cfg.microbatches,),
        gather=zero.gather,
        tensor_parallel_degrees=(tp,),
    )


def _choose(
    model: DistributedModel, fn: Callable[..., Any], whole: Any, st: State
) -> dict[str, Any]:
    """Rank 0: profile on the replica's batch and search; returns the resolved values."""
    from mpar.meta import find_units_meta
    from mpar.partition import find_units, search
    from mpar.profile import preserved_state, profile_mode, profile_model
    from mpar.runtime._local_stages import tp_splits_of

    cfg = st.config
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
    tp, layout = st.grid.tp_size, model.tp_layout
    splits = None if layout is None else tp_splits_of(module, profile, layout, args, kwargs)
    result = search(
        profile,
        world_size=st.grid.pp_size * st.grid.dp_size * tp,
        device_memory=cfg.device_memory or 0,
        global_batch=batch * st.grid.dp_size,
        profile_batch=batch,
        space=_space(cfg, cfg.auto_keys, tp),
        top=3,
        device=st.device.type,
        tp_splits=splits,
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
    fn: Callable[..., Any],
    model: DistributedModel,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
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
