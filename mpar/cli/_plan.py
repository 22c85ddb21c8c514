"""``mpar plan``: print the partition and memory plan of a model without running it.

    mpar plan --model pkg.module:factory --config cfg.json --world-size 8 \\
        [--device-memory 16GiB] [--link-bandwidth 10GB] [--meta] [--json]
    mpar plan --hf-config path/to/config.json --seq-len 4096 --batch 1 --world-size 16 ...

The factory returns a module or a ``(module, example_inputs)`` pair, where
``example_inputs`` is one microbatch: a tensor, a tuple of positional
arguments, or a dict of keyword arguments. With ``--meta`` the factory is
called under ``torch.device("meta")`` and the model is profiled from FLOPs
and shapes (nothing is allocated). ``--hf-config`` builds a Hugging Face model
from its config.json on the meta device (architecture from the config) and
synthesises one microbatch of ``--batch`` samples of ``--seq-len`` tokens (or
images), labels included, so a 7B model plans without a factory.

The config (JSON or YAML, read by ``mpar.config.load_config``; without
``--config`` the ``MPAR_CONFIG`` variable, else one pipeline over the whole
world) gives ``pipeline_parallel_degree``, ``virtual_stages``,
``microbatches``, ``pipeline``, ``optimize``, ``memory_weight`` and
``zero.stage``; data parallelism is ``world-size / pipeline_parallel_degree``.
With ``--global-batch`` each microbatch holds ``global-batch / dp / microbatches``
samples and the profiled microbatch's figures are scaled to it; without it, the
profiled microbatch is the plan's. The plan prints the microbatch size it assumed.

With ``--ep N`` (or the config's ``expert_parallel_degree``) on a mixture-of-experts
model the figures are one ep rank's: its ``E/N`` experts of each MoE layer, their ZeRO
state over the ``dp/N`` ranks holding the same experts, and each stage's time gains the
experts' all-to-alls over ``--ep-bandwidth`` (default: the link bandwidth); ep folds
into dp (it must divide it). See docs/expert_parallel.md.

With ``--tp N`` (or the config's ``tensor_parallel_degree``) the figures are one
tensor-parallel rank's: the model's TP plan (the config's ``tp_plan``, the model's
own ``base_model_tp_plan``, or mpar's plan for its family) is checked at ``N`` as
the runtime checks it, split parameters, their gradients and optimizer state count
``1/N``, activations saved inside split layers ``1/N``, and each stage's time gains
the TP collectives over ``--tp-bandwidth`` (default: the link bandwidth); dp =
world-size / (pp * N).

With ``--cp N`` (or the config's ``context_parallel_degree``) the figures are one
context-parallel rank's: the model's attention calls are found in one forward
(``scaled_dot_product_attention``, Hugging Face's ``"sdpa"``), activations, outputs
and per-sample time count ``1/N``, ZeRO shards over dp x cp, and each attention
layer's time gains its traffic (the config's ``context_parallel_method``) over
``--cp-bandwidth`` (default: the link bandwidth); dp = world-size / (pp * tp * N).
See docs/planning.md.

Memory is per rank of the device kind the plan is for (``--device``; default: the
config's ``device``, where ``auto`` means CUDA when this machine has it, else the
CPU). On a CPU device offloaded state stays in the same memory and counts in the
rank's figure; on CUDA or XLA it is reported as host memory beside it.

With ``--auto`` the layout itself is searched (``mpar.partition.search``):

    mpar plan --auto --hf-config config.json --seq-len 4096 --world-size 16 \\
        --device-memory 80GiB --global-batch 64 [--json]

tensor-parallel degree (the divisors of the world size the model's TP plan
accepts; tp = 1 without a plan), expert-parallel degree (a mixture-of-experts model:
the divisors of dp that divide its experts per layer), pipeline degree, virtual stages, microbatches,
schedule, ZeRO stage, offload, activation checkpointing and bf16, under the memory
cap, fastest predicted step first. The model is profiled once (at ``--batch`` samples with ``--hf-config``,
at the example inputs' first dimension with ``--model``) and scaled linearly to
each candidate's microbatch size. ``--json`` prints ``{"config", "predicted",
"candidates", "rejected", "plan"}``; ``config`` runs as is with ``mpar.init``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from typing import TYPE_CHECKING, TypeVar

from mpar._size import parse_bandwidth, parse_bytes
from mpar.errors import ConfigError, PartitionError

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from mpar.config import Config
    from mpar.partition import CPAttention, PlanInputs
    from mpar.partition._clusters import Cluster
    from mpar.profile import ModelProfile
    from mpar.tensor_parallel import ExampleInputs

    Profiled = tuple[ModelProfile, int, tuple[nn.Module, ExampleInputs]]
    """A profile, its samples per microbatch, and the module and inputs it profiled."""

__all__ = ["add_parser", "run"]

T = TypeVar("T")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``mpar plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="partition and memory plan of a model, without starting processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="pkg.module:factory")
    source.add_argument(
        "--hf-config",
        help="a Hugging Face config.json (or its folder): built on the meta device",
    )
    parser.add_argument(
        "--seq-len", type=int, default=512, help="with --hf-config: tokens per sample (512)"
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="with --hf-config: samples per microbatch (1)"
    )
    parser.add_argument("--config", help="mpar config file (JSON or YAML)")
    parser.add_argument("--world-size", type=int, required=True, help="total number of ranks")
    parser.add_argument("--device-memory", help="memory per device, e.g. 16GiB or 40GB")
    parser.add_argument(
        "--link-bandwidth",
        help="bytes per second between neighbouring stages, e.g. 10GB or 500MB (default: "
        "the cluster's between nodes, else 10GB); 'none' leaves communication out of the plan",
    )
    parser.add_argument(
        "--cluster",
        help="plan for a preset machine: h100, h200, a100 or tpu-v5p (device kind, memory, "
        "bf16 peak x assumed MFU, NVLink/ICI in a node for tp, InfiniBand between nodes, "
        "devices per node: tp stays within a node); --device cuda/xla without it assumes "
        "h100/tpu-v5p; flags given explicitly win",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        help="samples per step over all replicas; the profiled microbatch is scaled to "
        "global-batch / dp / microbatches samples (without --auto: default the profiled one)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "xla"),
        help="the device kind the ranks run on (default: the config's 'device'; 'auto' = "
        "cuda where this machine has it, else cpu); on cpu offloaded state counts in the "
        "rank's memory",
    )
    parser.add_argument(
        "--process-memory",
        help="bytes each rank's process holds besides tensors (default: the CPU runtime's "
        "measured 5MiB, 6MiB more per pipeline rank, 12MiB more under bf16/fp16); set it "
        "for your device, e.g. 1GiB",
    )
    _add_parallel_arguments(parser)
    parser.add_argument("--meta", action="store_true", help="build and profile on the meta device")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_auto_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The tensor- and expert-parallel degrees and their links."""
    parser.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel degree (default: the config's tensor_parallel_degree); with "
        "--auto: search only this degree",
    )
    parser.add_argument(
        "--cp",
        type=int,
        help="context-parallel degree (default: the config's context_parallel_degree); with "
        "--auto: search only this degree",
    )
    parser.add_argument(
        "--cp-bandwidth",
        help="bytes/s per rank of context-parallel attention traffic (default: the link "
        "bandwidth); 'none' leaves it out",
    )
    parser.add_argument(
        "--tp-bandwidth",
        help="bytes/s per rank in tensor-parallel collectives, e.g. 150GB for NVLink "
        "(default: the link bandwidth); 'none' leaves them out",
    )
    parser.add_argument(
        "--ep",
        type=int,
        help="expert-parallel degree for a mixture-of-experts model, folded into dp "
        "(default: the config's expert_parallel_degree); with --auto: search only this degree",
    )
    parser.add_argument(
        "--ep-bandwidth",
        help="bytes/s per rank in the expert all-to-alls, e.g. 50GB (default: the link "
        "bandwidth); 'none' leaves them out",
    )


def _add_auto_arguments(parser: argparse.ArgumentParser) -> None:
    auto = parser.add_argument_group("search the layout (--auto)")
    auto.add_argument("--auto", action="store_true", help="search the whole layout")
    auto.add_argument(
        "--host-bandwidth", help="device<->host bytes/s (default: the cluster's, else 10GB)"
    )
    auto.add_argument(
        "--host-memory",
        help="host memory per rank for offloaded state on a CUDA/XLA device, e.g. 64GiB "
        "(default: not capped; on a CPU device --device-memory is the one cap)",
    )
    auto.add_argument(
        "--dp-bandwidth", help="bytes/s per rank in data-parallel collectives (link bandwidth)"
    )
    auto.add_argument(
        "--bf16-speedup",
        type=float,
        default=2.0,
        help="assumed compute speedup of bf16 over the fp32 profile (2.0)",
    )
    auto.add_argument("--no-bf16", action="store_true", help="keep fp32")
    auto.add_argument("--no-offload", action="store_true", help="never offload to the host")
    auto.add_argument(
        "--no-checkpointing", action="store_true", help="never checkpoint activations"
    )
    auto.add_argument(
        "--block-checkpointing",
        action="store_true",
        help="also try per-block activation checkpointing (activation_checkpointing: "
        "'block'); tried by default now, the flag is kept and changes nothing",
    )
    auto.add_argument("--max-virtual-stages", type=int, default=4, help="(4)")
    auto.add_argument("--top", type=int, default=10, help="candidates to rank (10)")
    auto.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="share of --device-memory kept free for the memory model's error (0.1: lay "
        "out under 90%% of it; the picked config's device_memory says so)",
    )


def _load_factory(spec: str) -> Callable[[], object]:
    """The factory ``pkg.module:factory`` names, imported with the current folder on
    the import path (first, as ``python -m`` puts it; the ``mpar`` script's own folder
    is what Python puts there otherwise)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like pkg.module:factory, got {spec!r}")
    here = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == here for p in sys.path):
        sys.path.insert(0, here)
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {attr!r}")
    return factory


def _split_inputs(inputs: object) -> tuple[tuple[object, ...], dict[str, object]]:
    import torch

    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise ValueError(
        f"example inputs must be a tensor, a tuple of arguments or a dict of keyword "
        f"arguments, got {type(inputs).__name__}"
    )


def _build(spec: str, meta: bool) -> tuple[nn.Module, tuple[object, ...], dict[str, object]]:
    import torch

    factory = _load_factory(spec)
    if meta:
        with torch.device("meta"):
            made = factory()
    else:
        made = factory()
    if isinstance(made, torch.nn.Module):
        raise ValueError(
            f"{spec} returned a module without example inputs; return (module, example_inputs) "
            "with one microbatch of inputs so the model can be profiled"
        )
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"{spec} must return a module or a (module, example_inputs) pair")
    args, kwargs = _split_inputs(made[1])
    return made[0], args, kwargs


def _read_config(
    path: str | None,
    world_size: int,
    tp: int | None = None,
    ep: int | None = None,
    cp: int | None = None,
) -> Config:
    from mpar.config import Config, load_config

    config = load_config(path, defaults={"pipeline_parallel_degree": world_size})
    bare = path is None and load_config(None) == Config()  # no config given (nor MPAR_CONFIG)
    for flag, d in (("--tp", tp), ("--ep", ep), ("--cp", cp)):
        if d is not None and d < 1:
            raise ValueError(f"{flag} must be a positive integer, got {d}")
    if tp is not None or cp is not None:  # --tp and --cp win over the config's
        config = dataclasses.replace(
            config,
            tensor_parallel_degree=config.tensor_parallel_degree if tp is None else tp,
            context_parallel_degree=config.context_parallel_degree if cp is None else cp,
        )
        if bare:
            inner = config.tensor_parallel_degree * config.context_parallel_degree
            if world_size % inner:
                raise ValueError(f"--tp x --cp = {inner} does not divide --world-size {world_size}")
            config = dataclasses.replace(config, pipeline_parallel_degree=world_size // inner)
    if ep is not None:  # --ep wins over the config's; it needs data parallelism to fold into
        config = dataclasses.replace(config, expert_parallel_degree=ep)
        if bare:
            config = dataclasses.replace(config, pipeline_parallel_degree=1)
    config.check_world_size(world_size)
    if config.auto_keys:
        raise ValueError(
            f"the config has 'auto' values ({', '.join(config.auto_keys)}); plan them with "
            "`mpar plan --auto` (or give every key a value)"
        )
    return config


def plan_inputs_of(args: argparse.Namespace, config: Config) -> PlanInputs:
    """What ``mpar plan`` plans for: the one translation of ``config`` on ``--world-size``
    ranks (``mpar.partition.plan_inputs``, as the runtime makes it on its grid), for the
    ``--device`` kind, capped by ``--device-memory`` where given."""
    from mpar.partition import plan_inputs
    from mpar.partition._plan_inputs import plan_device

    kind = plan_device(device_kind(device_arg(args), config.device))
    inputs = plan_inputs(config, args.world_size, device=kind)
    memory = device_memory_of(args, cluster_of(args, kind))
    return inputs if memory is None else dataclasses.replace(inputs, device_memory=memory)


def device_arg(args: argparse.Namespace) -> str | None:
    """``--device``, else the ``--cluster``'s device kind."""
    if args.device is None and getattr(args, "cluster", None) is not None:
        from mpar.partition._clusters import cluster

        return cluster(args.cluster).device
    return str(args.device) if args.device is not None else None


def _profile(args: argparse.Namespace) -> Profiled:
    """Profile the model; returns the profile, its samples per microbatch and the
    ``(module, (args, kwargs))`` it profiled (for the TP plan).

    With ``--auto`` on a measured (not meta) model whose example holds two or more
    samples, a second profile at half of them fits each unit's per-call fixed
    time (``fit_fixed_times``), so small microbatches are not predicted too fast.
    """
    from mpar.profile import profile_model

    if args.hf_config is not None:
        from mpar.cli._hf_model import build_hf_model
        from mpar.runtime._adapt import disable_caches

        module, hf_kwargs = build_hf_model(args.hf_config, seq_len=args.seq_len, batch=args.batch)
        disable_caches(module)  # as DistributedModel does
        ex_args: tuple[object, ...] = ()
        ex_kwargs: dict[str, object] = dict(hf_kwargs)
        meta, batch = True, int(args.batch)
    else:
        module, ex_args, ex_kwargs = _build(args.model, args.meta)
        meta, batch = args.meta, _batch_of((ex_args, ex_kwargs))
    profile = profile_model(module, ex_args, ex_kwargs, mode="meta" if meta else "measure")
    if getattr(args, "auto", False) and not meta and batch >= 2:
        from mpar.partition import fit_fixed_times

        half_args, half_kwargs = _first_samples((ex_args, ex_kwargs), batch, batch // 2)
        half = profile_model(module, half_args, half_kwargs, units=profile.names)
        profile = fit_fixed_times(profile, batch, half, batch // 2)
    return profile, batch, (module, (ex_args, ex_kwargs))


def _first_samples(inputs: T, batch: int, keep: int) -> T:
    """The inputs with every tensor whose first dimension is ``batch`` cut to ``keep``."""
    import torch

    from mpar._compat import pytree

    def cut(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x[:keep]
        return x

    kept: T = pytree.tree_map(cut, inputs)
    return kept


def _batch_of(inputs: object) -> int:
    """Samples in the example inputs: the first dimension of their first tensor."""
    import torch

    from mpar._compat import pytree

    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def link_bandwidth(text: str | None, cluster: Cluster | None = None) -> float | None:
    """``--link-bandwidth`` in bytes per second ('none': communication left out; not
    given: the cluster's between nodes, else 10 GB/s)."""
    if text is None:
        return cluster.inter_node_bandwidth if cluster is not None else 10e9
    return None if text.lower() == "none" else parse_bandwidth(text, "link_bandwidth")


def cluster_of(args: argparse.Namespace, kind: str) -> Cluster | None:
    """The machine a plan is for: ``--cluster`` (its device kind must agree with
    ``--device``), else the default preset of the device kind (None on the CPU)."""
    from mpar.partition._clusters import cluster, default_cluster

    name = getattr(args, "cluster", None)
    if name is None:
        return default_cluster(kind)
    preset = cluster(name)
    if args.device not in (None, "auto", preset.device):
        raise ValueError(
            f"--cluster {preset.name} runs on {preset.device}, not --device {args.device}; "
            "leave out --device"
        )
    return preset


def for_cluster(profile: ModelProfile, preset: Cluster | None, speedup: float) -> ModelProfile:
    """The profile timed at the cluster's assumed speed (as profiled on the CPU)."""
    from mpar.partition._clusters import timed_by_flops

    return profile if preset is None else timed_by_flops(profile, preset, speedup)


def device_memory_of(args: argparse.Namespace, preset: Cluster | None) -> int | None:
    """``--device-memory`` in bytes, else the ``--cluster``'s (not a preset assumed from
    ``--device``), else the memory of this machine's device when the plan is for it
    (CUDA), else None."""
    from mpar import _device

    if args.device_memory is not None:
        return parse_bytes(args.device_memory)
    named = getattr(args, "cluster", None) is not None
    if named and preset is not None:
        return preset.memory_bytes
    return _device.total_memory(str(getattr(args, "device", None) or "auto"))


def device_kind(requested: str | None, configured: str = "auto") -> str:
    """The device kind a plan is for: ``--device``, else the config's, ``auto`` resolved
    as the runtime does (``mpar._device.pick_device``: CUDA where available, else CPU)."""
    from mpar import _device

    kind = requested if requested not in (None, "auto") else configured
    return _device.resolve_kind(str(kind))


def process_overrides(text: str | None) -> dict[str, int]:
    """``--process-memory``: one figure for every rank, pipelined or not, any precision."""
    if text is None:
        return {}
    return {
        "process_bytes": parse_bytes(text),
        "pipeline_process_bytes": 0,
        "moe_pipeline_process_bytes": 0,
        "mixed_process_bytes": 0,
    }


def microbatch_size(global_batch: int | None, dp: int, microbatches: int, profiled: int) -> int:
    """Samples per microbatch for ``--global-batch`` (the profiled ones without it)."""
    if global_batch is None:
        return profiled
    if global_batch < 1 or global_batch % (dp * microbatches):
        raise ValueError(
            f"--global-batch {global_batch} does not split into {dp} replica(s) x "
            f"{microbatches} microbatch(es) of equal whole size; give a multiple of "
            f"{dp * microbatches}"
        )
    return global_batch // (dp * microbatches)


def cp_bandwidth(args: argparse.Namespace, link: float | None) -> float | None:
    """``--cp-bandwidth`` in bytes per second (the link bandwidth without it)."""
    text = args.cp_bandwidth
    if text is None:
        return link
    return None if text.lower() == "none" else parse_bandwidth(text, "--cp-bandwidth")


def tp_bandwidth(
    args: argparse.Namespace, link: float | None, cluster: Cluster | None = None
) -> float | None:
    """``--tp-bandwidth`` in bytes per second (without it: the cluster's in a node,
    else the link bandwidth)."""
    text = args.tp_bandwidth
    if text is None:
        return link if cluster is None else cluster.intra_node_bandwidth
    return None if text.lower() == "none" else parse_bandwidth(text, "--tp-bandwidth")


def ep_bandwidth(args: argparse.Namespace, link: float | None) -> float | None:
    """``--ep-bandwidth`` in bytes per second (the link bandwidth without it)."""
    text = args.ep_bandwidth
    if text is None:
        return link
    return None if text.lower() == "none" else parse_bandwidth(text, "--ep-bandwidth")


def _run_plan(args: argparse.Namespace) -> str:
    from mpar.expert_parallel import measure_ep_splits
    from mpar.partition import CostModel, make_plan
    from mpar.tensor_parallel import tp_splits

    config = _read_config(args.config, args.world_size, args.tp, args.ep, args.cp)
    inputs = plan_inputs_of(args, config)
    preset = cluster_of(args, inputs.device)
    size = microbatch_size(
        args.global_batch, inputs.grid.dp, inputs.schedule.microbatches, 1
    )  # checked before profiling
    link = link_bandwidth(args.link_bandwidth, preset)
    cost = CostModel(
        link_bandwidth=link,
        tp_bandwidth=tp_bandwidth(args, link, preset),
        ep_bandwidth=ep_bandwidth(args, link),
        cp_bandwidth=cp_bandwidth(args, link),
        **process_overrides(args.process_memory),
    )
    profile, batch, (module, example) = _profile(args)
    profile = for_cluster(profile, preset, cost.mixed_speedup)
    tp = inputs.grid.tp
    if tp > 1:
        splits = tp_splits(module, profile, example, [tp], user_plan=config.tp_plan, required=tp)
        inputs = dataclasses.replace(inputs, tp_splits=splits)
    if inputs.grid.ep > 1:
        experts = measure_ep_splits(module, profile, example, plan=config.ep_plan)
        inputs = dataclasses.replace(inputs, ep_splits=experts)
    if inputs.grid.cp > 1:
        inputs = dataclasses.replace(inputs, cp_attention=attention_of(profile, module, example))
    size = size if args.global_batch is not None else batch
    try:
        plan = make_plan(
            profile, inputs, cost=cost, microbatch_scale=size / batch, microbatch_size=size
        )
    except PartitionError as exc:
        if args.config is None and "units; lower pipeline_parallel_degree" in str(exc):
            raise PartitionError(
                f"{exc} (without --config the plan puts one pipeline stage on each of the "
                f"--world-size {args.world_size} ranks: give a --config with a smaller "
                "pipeline_parallel_degree, or let --auto pick the layout)"
            ) from None
        raise
    return json.dumps(plan.to_dict(), indent=2) if args.json else str(plan)


def attention_of(profile: ModelProfile, module: nn.Module, example: ExampleInputs) -> CPAttention:
    """Where the profiled model attends (``mpar.partition.measure_attention``), on fake
    tensors for a meta-mode profile."""
    from mpar.partition import measure_attention

    args, kwargs = example
    return measure_attention(module, profile.units, args, kwargs, fake=profile.mode == "meta")


def run(args: argparse.Namespace) -> int:
    """Run ``mpar plan``; returns the exit status."""
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be a positive integer, got {args.world_size}")
        if args.auto:
            from mpar.cli._plan_auto import run_auto

            text = run_auto(args, _profile)
        else:
            text = _run_plan(args)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        # mpar's own config errors may list one key a line; others: their first line
        text = str(exc) if isinstance(exc, ConfigError) else str(exc).splitlines()[0]
        print(f"mpar plan: error: {text}", file=sys.stderr)
        return 2
    print(text)
    return 0
