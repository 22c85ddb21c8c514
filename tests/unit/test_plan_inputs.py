"""One translation from config to plan (``mpar.partition.plan_inputs``): the runtime's
partition and ``mpar plan`` hand the planner equal records for the same config.

Both real paths run up to ``make_plan`` and the record each hands it is compared: the
runtime's ``_decide_boundaries`` (the config as ``mpar.init`` loads it, the grid as it
builds it, the TP layout as ``DistributedModel`` checks it) and ``mpar plan``'s
``_run_plan`` (the config file as the CLI reads it, ``--world-size``, ``--device``).
The profile is shared (no processes, a meta model); the TP splits are measured by
each path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from types import SimpleNamespace

import pytest
import torch

import mpar.cli._plan as cli_plan
import mpar.partition
import mpar.profile
from mpar.cli import build_parser
from mpar.config import Config, config_from_dict, load_config
from mpar.errors import ConfigError, PartitionError
from mpar.partition import PlanInputs, ScheduleSetup, ZeroSetup, plan_inputs
from mpar.partition._plan_inputs import config_dict
from mpar.profile import profile_model
from mpar.runtime._local_stages import _decide_boundaries
from mpar.runtime._model import _tp_layout
from mpar.testing.models import GPT_TP_PLAN, GPTConfig, TinyGPT
from mpar.topology import Grid, GridShape

CASES = [
    ({}, 1),
    ({"pipeline_parallel_degree": 2, "microbatches": 4}, 2),
    ({"pipeline_parallel_degree": 2, "microbatches": 4}, 8),
    ({"partitions": 4, "microbatches": 8, "virtual_stages": 2}, 8),
    ({"partitions": 2, "microbatches": 4, "pipeline": "simple", "placement_strategy": "spread"}, 4),
    ({"partitions": 2, "microbatches": 8, "pipeline": "zero_bubble", "active_microbatches": 3}, 2),
    ({"partitions": 2, "microbatches": 8, "pipeline": "zero_bubble", "split_backward": False}, 4),
    ({"partitions": 2, "microbatches": 4, "pipeline": "zbv", "virtual_stages": 2}, 4),
    ({"partitions": 2, "microbatches": 6, "active_microbatches": 2, "optimize": "memory"}, 2),
    ({"partitions": 2, "microbatches": 2, "memory_weight": 0.5, "device_memory": "64GiB"}, 2),
    ({"partitions": 2, "bf16": True, "zero": {"stage": 1, "bucket_mb": 4}}, 8),
    ({"partitions": 2, "fp16": True, "zero": {"stage": 2, "gather": 2}}, 4),
    ({"zero": {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}}, 4),
    ({"zero": {"stage": 3, "gather": "chunk"}, "activation_checkpointing": "each"}, 2),
    ({"partitions": 2, "activation_checkpointing": True, "offload_activations": True}, 2),
    ({"partitions": 2, "activation_checkpointing": "none", "device": "cpu"}, 2),
    ({"partitions": 2, "tp": 2, "tp_plan": GPT_TP_PLAN, "microbatches": 2}, 4),
    ({"tp": 2, "tp_plan": GPT_TP_PLAN, "zero": {"stage": 1}, "placement_strategy": "TPD"}, 8),
    ({"partitions": 2, "tp": 2, "tp_plan": GPT_TP_PLAN, "bf16": True, "zero": {"stage": 3}}, 8),
    ({"partitions": 2, "tp": 2, "tp_plan": GPT_TP_PLAN, "optimize": "memory"}, 4),
]
"""(config, world size): every key the planner reads, each set somewhere."""


@functools.cache
def _model():
    """A meta TinyGPT (4 blocks, a plain plan splits it), one microbatch, its profile."""
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(num_layers=4, fused_qkv=False))
    x = torch.zeros(2, 8, dtype=torch.long)
    return model, x, profile_model(model, (x,), mode="meta")


@pytest.fixture
def handed(monkeypatch):
    """The records both paths hand ``make_plan`` (the profile is the shared meta one)."""
    model, x, profile = _model()
    seen: list[PlanInputs] = []
    real = mpar.partition.make_plan

    def make_plan(profile, inputs, **kw):
        seen.append(inputs)
        return real(profile, inputs, **kw)

    monkeypatch.setattr(mpar.partition, "make_plan", make_plan)
    monkeypatch.setattr(mpar.profile, "profile_model", lambda *a, **k: profile)
    monkeypatch.setattr(cli_plan, "_profile", lambda args: (profile, 2, (model, ((x,), {}))))
    return seen


def _runtime(path, world: int, device: torch.device) -> None:
    """The runtime's partition, as ``mpar.init`` and ``DistributedModel`` set it up."""
    model, x, profile = _model()
    config = load_config(str(path))  # what mpar.init does with its argument
    topology = Grid(world, config.pipeline_parallel_degree, config.placement_strategy,
                    config.tensor_parallel_degree)  # fmt: skip
    grid = SimpleNamespace(topology=topology, tp_size=topology.tp_size)
    st = SimpleNamespace(config=config, grid=grid, device=device)
    _decide_boundaries(model, (x,), {}, profile.names, st, _tp_layout(model, grid, config))


def _cli(path, world: int, device: str) -> None:
    argv = ["plan", "--model", "unused:factory", "--config", str(path), "--world-size",
            str(world), "--device", device]  # fmt: skip
    cli_plan._run_plan(build_parser().parse_args(argv))


@pytest.mark.parametrize(("config", "world"), CASES, ids=lambda c: json.dumps(c)[:40])
def test_the_runtime_and_mpar_plan_hand_the_planner_the_same_record(
    config, world, tmp_path, handed
):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    _runtime(path, world, torch.device("cpu"))
    _cli(path, world, "cpu")
    runtime, cli = handed
    assert runtime == cli
    cfg = load_config(str(path))
    assert runtime.grid == GridShape.for_world(
        world, pp=cfg.pipeline_parallel_degree, tp=cfg.tensor_parallel_degree
    )
    assert (runtime.grid.tp > 1) == (runtime.tp_splits is not None)


def test_the_device_kind_is_the_resolved_one(tmp_path, handed):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"partitions": 2, "zero": {"stage": 1, "offload_optimizer": "cpu"}}))
    _runtime(path, 4, torch.device("cuda"))  # a CUDA job (only its kind is read)
    _cli(path, 4, "cuda")
    runtime, cli = handed
    assert runtime == cli and runtime.device == "cuda"


def test_the_record_reads_every_key_the_planner_needs():
    config = config_from_dict(
        {
            "partitions": 2, "tp": 2, "microbatches": 8, "virtual_stages": 2,
            "pipeline": "zero_bubble", "active_microbatches": 4, "split_backward": False,
            "optimize": "memory", "memory_weight": 0.3, "device_memory": "2GiB",
            "zero": {"stage": 3, "offload_params": "cpu", "gather": 2, "bucket_mb": 8,
                     "prefetch": 2, "reduce": "step"},
            "fp16": True, "activation_checkpointing": "each",
        }
    )  # fmt: skip
    inputs = plan_inputs(config, 16, device="xla")
    assert inputs == PlanInputs(
        grid=GridShape(pp=2, dp=4, tp=2),
        schedule=ScheduleSetup("zero_bubble", 2, 8, 4, split_backward=False),
        zero=ZeroSetup(
            3, offload_params=True, gather=2, bucket_bytes=8 * 2**20, prefetch=2, reduce="step"
        ),
        precision="fp16",
        activation_checkpointing=True,
        device="xla",
        device_memory=2 * 2**30,
        optimize="memory",
        memory_weight=0.3,
    )
    # and back: the config the record describes gives the same record
    assert plan_inputs(config_from_dict(config_dict(inputs)), 16, device="xla") == inputs
    assert config.precision == "fp16" and config.checkpointing
    assert Config(bf16=True).precision == "bf16" and Config().precision == "fp32"
    assert not Config(activation_checkpointing="none").checkpointing


def test_a_grid_that_is_not_the_configs_is_refused():
    config = config_from_dict({"partitions": 2, "tp": 2})
    assert plan_inputs(config, GridShape(pp=2, dp=2, tp=2), device="cpu").grid.world_size == 8
    with pytest.raises(PartitionError, match="not the one the config lays out"):
        plan_inputs(config, GridShape(pp=4, dp=1, tp=2), device="cpu")
    with pytest.raises(ConfigError, match="world size"):
        plan_inputs(config, 6, device="cpu")
    with pytest.raises(PartitionError, match="device must be one of"):
        plan_inputs(config, 8, device="tpu")  # type: ignore[arg-type]


def test_the_grid_shape_is_one_record_of_the_axes():
    """A new axis is a field of GridShape: the world size and equality follow it."""
    assert GridShape(pp=2, dp=3, tp=2).world_size == 12
    assert GridShape.for_world(12, pp=2, tp=2) == GridShape(2, 3, 2)
    assert Grid(12, 2, "spread", 2).shape == GridShape(2, 3, 2)
    names = [f.name for f in dataclasses.fields(GridShape)]
    assert names == ["pp", "dp", "tp", "ep", "cp"]
    # ep folds into dp: no ranks of its own, and it must divide dp
    assert GridShape.for_world(8, pp=2, ep=2) == GridShape(pp=2, dp=4, ep=2)
    assert GridShape(pp=2, dp=4, ep=2).world_size == 8
    assert Grid(8, 2, "cluster", 1, 2).shape == GridShape(pp=2, dp=4, ep=2)
    with pytest.raises(ConfigError, match="must divide the data-parallel degree 3"):
        GridShape(dp=3, ep=2)
    assert GridShape.for_world(16, pp=2, tp=2, cp=2) == GridShape(pp=2, dp=2, tp=2, cp=2)
    assert Grid(16, 2, "spread", 2, cp_size=2).shape == GridShape(pp=2, dp=2, tp=2, cp=2)
    with pytest.raises(ConfigError, match="does not divide"):
        GridShape.for_world(6, pp=4)
    with pytest.raises(ConfigError, match="positive integer"):
        GridShape(pp=0)
