"""``mpar plan --auto``: search the layout for a memory budget (a thin shell over
``mpar.partition.search``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

__all__ = ["run_auto"]


def _options(args: argparse.Namespace) -> tuple[Any, Any]:
    from mpar.cli._plan import device_kind
    from mpar.partition import CostModel, SearchSpace
    from mpar.partition._planner import _bandwidth

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
    link = None if args.link_bandwidth.lower() == "none" else _bandwidth(args.link_bandwidth)
    dp = link if args.dp_bandwidth is None else _bandwidth(args.dp_bandwidth, "--dp-bandwidth")
    host = _bandwidth(args.host_bandwidth, "--host-bandwidth")
    from mpar.cli._plan import process_overrides, tp_bandwidth

    process = process_overrides(args.process_memory)
    if args.tp is not None and (args.tp < 1 or args.world_size % args.tp):
        raise ValueError(
            f"--tp {args.tp} must be a positive divisor of --world-size {args.world_size}"
        )
    cost = CostModel(
        link_bandwidth=link,
        dp_bandwidth=dp,
        tp_bandwidth=tp_bandwidth(args, link),
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
    )
    return space, cost


def _best_plan(profile: Any, result: Any, scale: float, splits: Any) -> Any:
    """``make_plan`` of the best candidate: its stages, with the same figures."""
    from mpar.partition import make_plan

    best = result.best
    return make_plan(
        profile,
        num_ranks=best.pipeline_parallel_degree,
        virtual_stages=best.virtual_stages,
        microbatches=best.microbatches,
        pipeline=best.pipeline,
        memory_weight=0.0,
        device_memory=result.device_memory,
        data_parallel_degree=best.data_parallel_degree,
        zero_stage=best.zero_stage,
        link_bandwidth=result.cost.link_bandwidth,
        precision=best.precision,
        activation_checkpointing=best.activation_checkpointing,
        offload_optimizer=best.offload_optimizer,
        offload_params=best.offload_params,
        microbatch_scale=scale,
        cost=result.cost,
        gather=best.gather,
        device=best.device,
        microbatch_size=best.microbatch_size,
        tensor_parallel_degree=best.tensor_parallel_degree,
        tp_splits=splits,
    )


def run_auto(args: argparse.Namespace, profile_fn: Callable[[argparse.Namespace], Any]) -> str:
    """Profile once, search, and format the result (table or JSON)."""
    from mpar.cli._plan import device_kind
    from mpar.cli._plan_tp import tp_splits
    from mpar.partition import search

    space, cost = _options(args)
    device = device_kind(args.device)
    profile, batch, (module, inputs) = profile_fn(args)
    degrees = space.tensor_parallel_degrees or [
        d for d in range(2, args.world_size + 1) if args.world_size % d == 0
    ]
    splits = tp_splits(module, profile, inputs, degrees, required=args.tp)
    result = search(
        profile,
        world_size=args.world_size,
        device_memory=args.device_memory,
        global_batch=args.global_batch,
        profile_batch=batch,
        space=space,
        cost=cost,
        top=args.top,
        device=device,
        host_memory=args.host_memory,
        tp_splits=splits,
    )
    plan = _best_plan(profile, result, result.best.microbatch_size / batch, splits)
    if args.json:
        return json.dumps({**result.to_dict(), "plan": plan.to_dict()}, indent=2)
    return f"{result}\n\nbest layout, stage by stage:\n{plan}"
