"""``mpar plan --auto``: search the layout for a memory budget (a thin shell over
``mpar.partition.search``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from mpar._size import parse_bandwidth, parse_bytes

if TYPE_CHECKING:
    from mpar.cli._plan import Profiled
    from mpar.partition import CostModel, SearchSpace

__all__ = ["run_auto"]


def _options(args: argparse.Namespace) -> tuple[SearchSpace, CostModel]:
    from mpar.cli._plan import (
        cp_bandwidth,
        device_kind,
        link_bandwidth,
        process_overrides,
        tp_bandwidth,
    )
    from mpar.partition import CostModel, SearchSpace

    if args.device_memory is None:
        raise ValueError("--auto needs --device-memory (bytes per rank, e.g. 80GiB)")
    if args.global_batch is None:
        raise ValueError("--auto needs --global-batch (samples per step over all replicas)")
    if args.config is not None:
        raise ValueError("--auto searches the layout itself; leave out --config")
    if args.host_memory is not None and device_kind(args.device) == "cpu":
        raise ValueError(
            "--host-memory caps offloaded state on a CUDA or XLA device; on a CPU device the "
            "host is the device and --device-memory is the one cap (or plan with --device cuda)"
        )
    link = link_bandwidth(args.link_bandwidth)
    dp = link if args.dp_bandwidth is None else parse_bandwidth(args.dp_bandwidth, "--dp-bandwidth")
    host = parse_bandwidth(args.host_bandwidth, "--host-bandwidth")
    process = process_overrides(args.process_memory)
    if args.tp is not None and (args.tp < 1 or args.world_size % args.tp):
        raise ValueError(
            f"--tp {args.tp} must be a positive divisor of --world-size {args.world_size}"
        )
    if args.cp is not None and (args.cp < 1 or args.world_size % args.cp):
        raise ValueError(
            f"--cp {args.cp} must be a positive divisor of --world-size {args.world_size}"
        )
    cost = CostModel(
        link_bandwidth=link,
        dp_bandwidth=dp,
        tp_bandwidth=tp_bandwidth(args, link),
        cp_bandwidth=cp_bandwidth(args, link),
        host_bandwidth=host or 10e9,
        mixed_speedup=args.bf16_speedup,
        **process,
    )
    space = SearchSpace(
        max_virtual_stages=args.max_virtual_stages,
        offload=not args.no_offload,
        checkpointing=(False,) if args.no_checkpointing else (False, True),
        precisions=("fp32",) if args.no_bf16 else ("fp32", "bf16"),
        tensor_parallel_degrees=None if args.tp is None else (args.tp,),
        context_parallel_degrees=None if args.cp is None else (args.cp,),
    )
    return space, cost


def run_auto(args: argparse.Namespace, profile_fn: Callable[[argparse.Namespace], Profiled]) -> str:
    """Profile once, search, and format the result (table or JSON)."""
    from mpar.cli._plan import attention_of, device_kind
    from mpar.config import Config
    from mpar.partition import make_plan, plan_inputs, search
    from mpar.partition._plan_inputs import plan_device
    from mpar.tensor_parallel import tp_splits

    space, cost = _options(args)
    device = plan_device(device_kind(args.device))
    profile, batch, (module, inputs) = profile_fn(args)
    degrees = space.tensor_parallel_degrees or [
        d for d in range(2, args.world_size + 1) if args.world_size % d == 0
    ]
    splits = tp_splits(module, profile, inputs, degrees, required=args.tp)
    attention = attention_of(profile, module, inputs)
    base = plan_inputs(
        Config(), args.world_size, device=device, tp_splits=splits, cp_attention=attention
    )
    base = dataclasses.replace(base, device_memory=parse_bytes(args.device_memory))
    result = search(
        profile,
        base,
        global_batch=args.global_batch,
        profile_batch=batch,
        space=space,
        cost=cost,
        top=args.top,
        host_memory=args.host_memory,
    )
    best = result.best  # the best candidate's stages, with the same figures
    size = best.microbatch_size
    plan = make_plan(
        profile, best.inputs, cost=result.cost, microbatch_scale=size / batch, microbatch_size=size
    )
    if args.json:
        return json.dumps({**result.to_dict(), "plan": plan.to_dict()}, indent=2)
    return f"{result}\n\nbest layout, stage by stage:\n{plan}"
