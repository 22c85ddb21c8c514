"""Glue between the runtime and ``mpar.shard`` (ZeRO stages 1-3, mixed precision)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mpar import _device
from mpar.comm import State
from mpar.partition._memory_model import effective_gather
from mpar.runtime._local_stages import LocalStages
from mpar.runtime._precision import compute_dtype, reduce_dtype
from mpar.runtime._split_backward import accumulate_weight_grads, deferred_linear
from mpar.runtime._unit_hooks import Gate, group_units, install_groups
from mpar.shard import ShardedStages
from mpar.shard._bucket_layout import GroupInfo
from mpar.shard._unit_gather import WeightGradHooks

__all__ = ["gathered", "make_sharded", "stage_units"]

Inputs = tuple[tuple[object, ...], dict[str, object]]
"""A model call's ``(args, kwargs)``."""


def make_sharded(
    stages: LocalStages,
    st: State,
    example: Inputs | None = None,
    materialize: Callable[[torch.Tensor], None] | None = None,
) -> ShardedStages | None:
    """ZeRO sharding of this rank's stages over its data-parallel (x context-parallel)
    group: the ranks that hold the same parameters.

    Every training layout goes through it (ZeRO stage 0 is plain data
    parallelism over the same flat buckets); None only without data parallelism,
    ZeRO, mixed precision or parameters tied across pipeline ranks: nothing to
    reduce or shard. ``example``
    (the first microbatch's model inputs) finds the units of a stage that is
    the whole model (``pipeline_parallel_degree`` 1) for unit-granular ZeRO.
    ``materialize`` (a meta model) gives a parameter its value right before its
    bucket copies it (see ``mpar.meta``).
    """
    zero, dtype = st.config.zero, compute_dtype(st.config)
    if zero.stage == 0 and dtype is None and st.grid.dp_cp_size == 1 and not stages.tied_groups:
        return None
    groups = _unit_groups(stages, st, example)
    owners: dict[int, list[list[nn.Parameter]]] = {}
    connect: dict[int, Callable[[Gate], None]] = {}
    unread: set[int] = set()
    for s, names in groups.items():
        connect[s], owner, unread_here = install_groups(stages.modules[s], names)
        unread |= unread_here
        elsewhere = _other_stages_parameters(s, stages)
        params: list[list[nn.Parameter]] = [[] for _ in names]
        for p in stages.modules[s].parameters():
            g = owner.get(id(p))
            if g is not None and id(p) not in elsewhere:
                params[g].append(p)
        owners[s] = params
    sharded = ShardedStages(
        stages.modules,
        zero,
        group=st.grid.dp_cp_group,  # the ranks holding these parameters: dp x cp
        group_ranks=st.grid.dp_cp_ranks,
        rank_in_group=st.grid.dp_cp_rank,
        device=st.device,
        compute_dtype=dtype,
        reduce_dtype=reduce_dtype(st.config),
        tied=stages.tied_groups,
        units=owners,
        materialize=materialize,
        tp_size=stages.tp_size,
        tp_split=stages.tp_split,
        unread_in_backward=unread,
        weight_grads=WeightGradHooks(deferred_linear, accumulate_weight_grads),
        experts=stages.expert_params,
        expert_comm=GroupInfo(st.grid.edp_group, tuple(st.grid.edp_ranks), st.grid.edp_rank),
    )
    for s, install in connect.items():
        install(sharded.unit_gather(s))
    return sharded


def _other_stages_parameters(s: int, stages: LocalStages) -> set[int]:
    """ids of the parameters this rank's stages other than ``s`` use."""
    return {id(p) for t, m in stages.modules.items() if t != s for p in m.parameters()}


def stage_units(stages: LocalStages, s: int, st: State, example: Inputs | None) -> list[str]:
    """Stage ``s``'s partition units in order; for a stage that is the whole model
    (``pipeline_parallel_degree`` 1), found from ``example`` (none without it)."""
    names = stages.unit_names[s] if s < len(stages.unit_names) else []
    if names != ["<whole model>"]:
        return names
    if example is None:
        return []
    from mpar.meta import find_units_meta, has_meta
    from mpar.partition import find_units
    from mpar.profile import preserved_state

    module = stages.modules[s]
    args, kwargs = _device.to_device(example, st.device)
    if has_meta(module):
        return find_units_meta(module, args, kwargs)
    with torch.no_grad(), preserved_state(module):
        return find_units(module, args, kwargs)


def _unit_groups(
    stages: LocalStages, st: State, example: Inputs | None
) -> dict[int, list[list[str]]]:
    """Stage -> its unit groups, where ZeRO works unit by unit (see ``_unit_hooks``).

    None where the parameters' group is one rank that keeps them on the device: it
    has nothing to gather or reduce-scatter (``FlatBucket`` keeps its parameters in
    place), so unit hooks would only cost time."""
    cfg = st.config
    gather = effective_gather(cfg.pipeline, cfg.zero.gather)  # the planner predicts the same
    if cfg.zero.stage < 2 or gather == "chunk":
        return {}
    if st.grid.dp_cp_size == 1 and st.grid.edp_size == 1 and cfg.zero.offload_params != "cpu":
        return {}
    out: dict[int, list[list[str]]] = {}
    for s in stages.modules:
        names = stage_units(stages, s, st, example)
        if len(names) > 1:
            out[s] = group_units(names, gather)
    return out


@contextmanager
def gathered(
    sharded: ShardedStages | None, stages: LocalStages, *, write_back: bool = False
) -> Iterator[None]:
    """Every local stage's full parameters while inside (collective over dp at ZeRO-3).

    With ``write_back`` the (possibly overwritten) parameters are copied back
    into the shards and optimizer master copies on exit.
    """
    if sharded is None:
        yield
        return
    for s in sorted(stages.modules):
        sharded.unshard(s)
    try:
        yield
    finally:
        for s in sorted(stages.modules):
            if write_back:
                sharded.sync_from_params(s)
            sharded.reshard(s)
