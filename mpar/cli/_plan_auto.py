"""``mpar plan --auto``: search the layout for a memory budget (a thin shell over
``mpar.partition.search``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from mpar._size import parse_bandwidth

if TYPE_CHECKING:
    from mpar.cli._plan import Profiled
    from mpar.partition import CostModel, SearchSpace
    from mpar.partition._clusters import Cluster
    from mpar.partition._memory_model import Checkpointing

__all__ = ["run_auto"]


def _options(
    args: argparse.Namespace, preset: Cluster | None, world: int
) -> tuple[SearchSpace, CostModel]:
    from mpar.cli._plan import (
        cp_bandwidth,
        device_kind,
        device_memory_of,
        ep_bandwidth,
        link_bandwidth,
        process_overrides,
        tp_bandwidth,
    )
    from mpar.partition import CostModel, SearchSpace

    if device_memory_of(args, None) is None and args.cluster is None:
        raise ValueError(
            "--auto needs --device-memory (bytes per rank, e.g. 80GiB) or --cluster "
            "(read from the device when planning for this machine's GPU)"
        )
    if args.global_batch is None:
        raise ValueError("--auto needs --global-batch (samples per step over all replicas)")
    if args.config is not None:
        raise ValueError("--auto searches the layout itself; leave out --config")
    if args.host_memory is not None and device_kind(args.device) == "cpu" and preset is None:
        raise ValueError(
            "--host-memory caps offloaded state on a CUDA or XLA device; on a CPU device the "
            "host is the device and --device-memory is the one cap (or plan with --device cuda)"
        )
    link = link_bandwidth(args.link_bandwidth, preset)
    dp = link if args.dp_bandwidth is None else parse_bandwidth(args.dp_bandwidth, "--dp-bandwidth")
    host = _host_bandwidth(args.host_bandwidth, preset)
    _check_degrees(args, world)
    cost = CostModel(
        link_bandwidth=link,
        dp_bandwidth=dp,
        tp_bandwidth=tp_bandwidth(args, link, preset),
        ep_bandwidth=ep_bandwidth(args, link),
        cp_bandwidth=cp_bandwidth(args, link),
        host_bandwidth=host,
        mixed_speedup=args.bf16_speedup,
        **process_overrides(args.process_memory),
    )
    space = SearchSpace(
        max_virtual_stages=args.max_virtual_stages,
        offload=not args.no_offload,
        checkpointing=_checkpointing(args),
        precisions=("fp32",) if args.no_bf16 else ("fp32", "bf16"),
        tensor_parallel_degrees=_tp_degrees(args.tp, world, preset),
        expert_parallel_degrees=None if args.ep is None else (args.ep,),
        context_parallel_degrees=None if args.cp is None else (args.cp,),
    )
    return space, cost


def _check_degrees(args: argparse.Namespace, world: int) -> None:
    """``--tp`` and ``--cp`` divide the world; ``--ep`` and ``--cp`` above 1 are not
    combined (the config refuses them together)."""
    for flag, degree in (("--tp", args.tp), ("--cp", args.cp)):
        if degree is not None and (degree < 1 or world % degree):
            raise ValueError(f"{flag} {degree} must be a positive divisor of --world-size {world}")
    if (args.ep or 1) > 1 and (args.cp or 1) > 1:
        raise ValueError(
            f"--ep {args.ep} with --cp {args.cp}: context and expert parallelism above 1 "
            "together are not supported yet; search one of them"
        )


def _checkpointing(args: argparse.Namespace) -> tuple[Checkpointing, ...]:
    """Checkpointing off only (``--no-checkpointing``), else the search's default, with
    per-block checkpointing where ``--block-checkpointing`` asks for it."""
    from mpar.partition._search import CHECKPOINTING

    if args.no_checkpointing:
        return (False,)
    wanted = (*CHECKPOINTING, "block") if args.block_checkpointing else CHECKPOINTING
    return tuple(dict.fromkeys(wanted))


def _host_bandwidth(text: str | None, preset: Cluster | None) -> float:
    if text is not None:
        return parse_bandwidth(text, "--host-bandwidth") or 10e9
    return 10e9 if preset is None else preset.host_bandwidth


def _tp_degrees(tp: int | None, world: int, preset: Cluster | None) -> tuple[int, ...] | None:
    """``--tp``, else on a cluster the divisors of the world within a node (tp stays on
    NVLink), else None (every divisor)."""
    if tp is not None:
        return (tp,)
    if preset is None:
        return None
    return tuple(d for d in range(1, preset.devices_per_node + 1) if world % d == 0)


def run_auto(args: argparse.Namespace, profile_fn: Callable[[argparse.Namespace], Profiled]) -> str:
    """Profile once, search, and format the result (table or JSON)."""
    from mpar.cli._plan import (
        attention_of,
        cluster_of,
        device_arg,
        device_kind,
        device_memory_of,
        for_cluster,
    )
    from mpar.config import Config
    from mpar.expert_parallel import measure_ep_splits
    from mpar.partition import make_plan, plan_inputs, search
    from mpar.partition._plan_inputs import plan_device
    from mpar.tensor_parallel import tp_splits

    device = plan_device(device_kind(device_arg(args)))
    preset = cluster_of(args, device)
    space, cost = _options(args, preset, args.world_size)
    profile, batch, (module, inputs) = profile_fn(args)
    profile = for_cluster(profile, preset, cost.mixed_speedup)
    degrees = space.tensor_parallel_degrees or [
        d for d in range(2, args.world_size + 1) if args.world_size % d == 0
    ]
    splits = tp_splits(module, profile, inputs, degrees, required=args.tp)
    experts = measure_ep_splits(module, profile, inputs)
    if args.ep not in (None, 1) and not experts.experts:
        raise ValueError(f"--ep {args.ep}: the model has no experts module ({experts.source})")
    attention = attention_of(profile, module, inputs)
    base = plan_inputs(
        Config(),
        args.world_size,
        device=device,
        tp_splits=splits,
        ep_splits=experts,
        cp_attention=attention,
    )
    base = dataclasses.replace(base, device_memory=device_memory_of(args, preset))
    result = search(
        profile,
        base,
        global_batch=args.global_batch,
        profile_batch=batch,
        space=space,
        cost=cost,
        top=args.top,
        host_memory=args.host_memory,
        headroom=args.headroom,
    )
    result = dataclasses.replace(
        result,
        tokens_per_sample=args.seq_len if args.hf_config is not None else None,
        peak_flops=None if preset is None else preset.bf16_flops,
        flops_per_sample=sum(u.flops for u in profile.units) / batch,
    )
    best = result.best  # the best candidate's stages, with the same figures
    size = best.microbatch_size
    plan = make_plan(
        profile, best.inputs, cost=result.cost, microbatch_scale=size / batch, microbatch_size=size
    )
    where = [] if preset is None else [preset.describe()]
    if preset is not None and args.cluster is None:
        where.append(f"(assumed for --device {preset.device}; name the machine with --cluster)")
    if args.json:
        return json.dumps(
            {**result.to_dict(), "plan": plan.to_dict(), "cluster": _cluster_dict(preset)},
            indent=2,
        )
    return "\n".join([str(result), *where, "", "best layout, stage by stage:", str(plan)])


def _cluster_dict(preset: Cluster | None) -> dict[str, object] | None:
    return None if preset is None else dataclasses.asdict(preset)
