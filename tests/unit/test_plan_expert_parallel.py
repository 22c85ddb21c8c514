"""The planner under expert parallelism: one ep rank's experts and their ZeRO state, the
all-to-all bytes of docs/expert_parallel.md in the plan record, ep in the ``--auto``
search, and ``mpar plan --ep`` / ``--auto`` (pure: profiles on the meta device)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from mpar.config import Config
from mpar.errors import PartitionError
from mpar.expert_parallel import measure_ep_splits
from mpar.partition import (
    CostModel,
    PlanInputs,
    ScheduleSetup,
    SearchSpace,
    ZeroSetup,
    make_plan,
    plan_inputs,
    search,
)
from mpar.partition._ep_share import EPSplits, ep_share
from mpar.partition._plan_inputs import config_dict
from mpar.partition._search import EP_REFUSED
from mpar.profile import profile_model
from mpar.testing.models import MOE_EP_PLAN, MoEConfig, TinyMoE
from mpar.topology import GridShape

B, T = 2, 8
MIXTRAL_8X7B = Path(__file__).resolve().parents[2] / "examples/hf_configs/mixtral-8x7b.json"


@functools.lru_cache(maxsize=4)
def _moe(**kw):
    """A meta TinyMoE, its config, one microbatch, its profile and its measured experts
    (shared: none mutates them)."""
    cfg = MoEConfig(**{"per_expert": False, **kw})
    with torch.device("meta"):
        model = TinyMoE(cfg)
    x = torch.zeros(B, T, dtype=torch.long)
    profile = profile_model(model, (x,), mode="meta")
    experts = measure_ep_splits(model, profile, ((x,), {}), plan=MOE_EP_PLAN)
    return model, cfg, x, profile, experts


def _expert_params(cfg: MoEConfig) -> int:
    """Parameters of one MoE layer's experts (every expert)."""
    d, f = cfg.d_model, cfg.d_expert
    return cfg.num_experts * ((d * f + f + f * d + d) if cfg.per_expert else 2 * d * f)


def _a2a_bytes(cfg: MoEConfig, ep: int, b: int = 4, w: int = 4) -> float:
    """docs/expert_parallel.md: one rank's all-to-all bytes per MoE layer and microbatch,
    routing spread evenly: ``2 T k (ep - 1)/ep (2 H b + w) + (ep - 1)(E / ep) 8``."""
    pairs = B * T * cfg.top_k
    return 2 * pairs * (ep - 1) / ep * (2 * cfg.d_model * b + w) + (
        (ep - 1) * (cfg.num_experts // ep) * 8
    )


def test_measured_experts_are_the_experts_parameters_and_routed_rows():
    _model, cfg, _x, profile, experts = _moe()
    assert experts.experts == (cfg.num_experts,) * cfg.num_layers
    assert set(experts.units) == {f"blocks.{i}" for i in range(cfg.num_layers)}
    for unit in experts.units.values():
        assert unit.param_count == _expert_params(cfg) and unit.param_bytes == 4 * unit.param_count
        assert unit.pairs == B * T * cfg.top_k and unit.layers == 1
        assert unit.row_bytes == B * T * cfg.top_k * cfg.d_model * 4
    assert experts.degrees(4) == [1, 2, 4] and experts.degrees(6) == [1, 2]
    none = measure_ep_splits(_model, profile, ((_x,), {}))  # no plan: TinyMoE has no router
    assert none.experts == () and "no experts" in none.source
    # per-expert modules in a ModuleList are units of their own: each holds its expert,
    # the first the layer's routed rows
    *_, listed = _moe(per_expert=True)
    cfg = dataclasses.replace(cfg, per_expert=True)
    assert len(listed.units) == cfg.num_layers * cfg.num_experts
    assert sum(u.param_count for u in listed.units.values()) == cfg.num_layers * _expert_params(cfg)
    assert sum(u.pairs for u in listed.units.values()) == cfg.num_layers * B * T * cfg.top_k


def test_ep_share_keeps_one_ranks_experts_and_counts_the_all_to_alls():
    _model, cfg, _x, profile, experts = _moe()
    half = ep_share(profile, experts, 2, dp=2)
    assert ep_share(profile, experts, 1, dp=2) is profile
    for whole, rank in zip(profile.units, half.units):
        if whole.name in experts.units:
            assert whole.param_count - rank.param_count == _expert_params(cfg) // 2
            assert rank.expert_param_bytes == 4 * _expert_params(cfg) // 2
            assert rank.ep_comm_bytes == int(_a2a_bytes(cfg, 2))
            assert rank.flops == whole.flops  # each rank's experts see T k rows on average
        else:
            assert rank == whole
    assert profile.param_count - half.param_count == cfg.num_layers * _expert_params(cfg) // 2
    with pytest.raises(PartitionError, match="experts per layer"):
        ep_share(profile, experts, 3, dp=3)  # 4 experts do not split 3 ways
    with pytest.raises(PartitionError, match="no experts module"):
        ep_share(profile, EPSplits(source="none found"), 2, dp=2)


def test_the_plan_record_carries_ep_and_its_experts():
    *_, experts = _moe()
    config = Config(expert_parallel_degree=2, pipeline_parallel_degree=2)
    inputs = plan_inputs(config, 8, device="cpu", ep_splits=experts)
    assert inputs.grid == GridShape(pp=2, dp=4, ep=2) and inputs.ep_splits is experts
    assert inputs.memory_layout(1.0).expert_parallel_degree == 2
    assert config_dict(inputs)["expert_parallel_degree"] == 2
    assert "expert_parallel_degree" not in config_dict(plan_inputs(Config(), 8, device="cpu"))
    with pytest.raises(Exception, match="expert parallelism folds into them"):
        plan_inputs(Config(expert_parallel_degree=4, pipeline_parallel_degree=4), 8, device="cpu")


def test_plan_at_ep2_halves_expert_state_and_counts_the_all_to_alls():
    _model, cfg, _x, profile, experts = _moe(num_layers=4)
    m, bandwidth = 2, 1e9
    cost = CostModel(ep_bandwidth=bandwidth)
    run = PlanInputs(GridShape(pp=2, dp=2), ScheduleSetup(microbatches=m), ep_splits=experts)
    one = make_plan(profile, run, cost=cost)
    two = make_plan(profile, dataclasses.replace(run, grid=GridShape(pp=2, dp=2, ep=2)), cost=cost)
    # ZeRO 0, fp32 Adam: parameters, gradients and two moments of half the experts go
    saved = (4 + 4 + 8) * _expert_params(cfg) // 2
    state = sum(s.state_bytes for s in one.stages) - sum(s.state_bytes for s in two.stages)
    assert state == cfg.num_layers * saved
    assert sum(two.ep_comm_bytes) == pytest.approx(m * cfg.num_layers * _a2a_bytes(cfg, 2), 1e-6)
    assert sum(one.ep_comm_bytes) == 0 and one.expert_parallel_degree == 1
    a2a = int(_a2a_bytes(cfg, 2)) / bandwidth  # per MoE layer and microbatch
    for stage in two.stages:
        assert stage.tp_comm_s == pytest.approx(a2a * sum(u in experts.units for u in stage.units))
    compute = sum(s.time_s - s.tp_comm_s for s in two.stages)
    assert compute == pytest.approx(sum(s.time_s for s in one.stages), rel=1e-3)
    assert two.expert_parallel_degree == 2 and two.to_dict()["ep_comm_bytes"] == two.ep_comm_bytes
    assert "expert parallel x2" in str(two) and "expert all-to-alls send" in str(two)
    with pytest.raises(PartitionError, match="ep_splits"):
        make_plan(profile, PlanInputs(GridShape(pp=2, dp=2, ep=2)))


def test_a_pipeline_of_a_moe_model_counts_process_memory_per_moe_layer():
    """Calibration row 28 (pp 2 x dp 2, ep 2): capturing the routing's data-dependent
    shapes leaves process memory per MoE layer on every pipeline rank; pp 1 captures
    nothing, and a plan without the experts charges only the pipeline's own."""
    _model, cfg, _x, profile, experts = _moe(num_layers=4)
    cost = CostModel(moe_pipeline_process_bytes=3 * 2**20)
    run = PlanInputs(GridShape(pp=2, dp=2, ep=2), ScheduleSetup(microbatches=2), ep_splits=experts)
    moe = make_plan(profile, run, cost=cost)
    dense = make_plan(profile, dataclasses.replace(run, grid=GridShape(pp=2, dp=2)), cost=cost)
    assert len(experts.experts) == cfg.num_layers
    extra = cfg.num_layers * 3 * 2**20
    assert moe.process_bytes == cost.process_bytes + cost.pipeline_process_bytes + extra
    flat = make_plan(profile, dataclasses.replace(run, grid=GridShape(dp=4, ep=2)), cost=cost)
    assert flat.process_bytes == cost.process_bytes
    assert dense.process_bytes == moe.process_bytes  # the experts are known at ep 1 too
    with pytest.raises(PartitionError, match="moe_pipeline_process_bytes must be >= 0"):
        CostModel(moe_pipeline_process_bytes=-1)


def test_zero_shards_expert_state_over_the_expert_data_parallel_group():
    _model, cfg, _x, profile, experts = _moe(num_layers=2)
    grid = GridShape(dp=4, ep=2)
    run = PlanInputs(grid, zero=ZeroSetup(stage=3), ep_splits=experts)
    plan = make_plan(profile, run)
    base = make_plan(profile, dataclasses.replace(run, grid=GridShape(dp=4)))
    # ZeRO-3 over dp = 4: everything 1/4; at ep = 2 a rank holds half the experts, sharded
    # over the dp / ep = 2 ranks holding the same ones: 1/4 of the experts too
    experts_bytes = (4 + 4 + 8) * cfg.num_layers * _expert_params(cfg)
    assert sum(s.state_bytes for s in base.stages) - sum(
        s.state_bytes for s in plan.stages
    ) == pytest.approx(0, abs=64)
    assert sum(s.state_bytes for s in base.stages) >= experts_bytes / 4
    ep4 = make_plan(profile, dataclasses.replace(run, grid=GridShape(dp=4, ep=4)))
    assert sum(s.state_bytes for s in ep4.stages) == pytest.approx(
        sum(s.state_bytes for s in plan.stages), abs=64
    )  # E/4 experts each whole on its rank: the same bytes
    # ZeRO-1: the experts' reduced gradient shards (1/(dp/ep)) sit beside their whole
    # gradients until the step; at ep = dp the shard is all of them
    z1 = PlanInputs(GridShape(dp=2), zero=ZeroSetup(stage=1), ep_splits=experts)
    one = make_plan(profile, z1)
    two = make_plan(profile, dataclasses.replace(z1, grid=GridShape(dp=2, ep=2)))
    extra = sum(s.extra_bytes for s in two.stages) - sum(s.extra_bytes for s in one.stages)
    assert extra == pytest.approx(4 * cfg.num_layers * _expert_params(cfg) // 2, abs=8)


def _space(**kw) -> SearchSpace:
    return SearchSpace(
        pipelines=("interleaved",), zero_stages=(0,), offload=False, checkpointing=(False,),
        precisions=("fp32",), max_virtual_stages=1, **kw,
    )  # fmt: skip


def test_search_tries_the_ep_degrees_the_experts_take():
    *_, profile, experts = _moe()
    base = PlanInputs(GridShape(dp=4), device_memory=2**30, ep_splits=experts)
    result = search(profile, base, global_batch=8, profile_batch=B, space=_space(), top=1000)
    by_dp = {}
    for c in result.ranked:
        by_dp.setdefault(c.data_parallel_degree, set()).add(c.expert_parallel_degree)
        assert c.config().get("expert_parallel_degree", 1) == c.expert_parallel_degree
    assert by_dp == {4: {1, 2, 4}, 2: {1, 2}, 1: {1}}
    assert result.to_dict()["ep_degrees"] == [1, 2, 4]
    only = search(
        profile, base, global_batch=8, profile_batch=B,
        space=_space(expert_parallel_degrees=(2, 3)), top=1000,
    )  # fmt: skip
    assert {c.expert_parallel_degree for c in only.ranked} == {2}
    assert only.rejected[EP_REFUSED] > 0
    plain = search(
        profile, dataclasses.replace(base, ep_splits=None), global_batch=8, space=_space()
    )
    assert {c.expert_parallel_degree for c in plain.ranked} == {1}


def test_search_needs_ep_when_only_an_ep_rank_fits():
    *_, profile, experts = _moe(num_layers=2, d_model=64, d_expert=4096, num_experts=8)
    space = _space(pipeline_degrees=(1,))
    kw = {"global_batch": 4, "profile_batch": B, "space": space, "top": 1000}
    whole = search(
        profile, PlanInputs(GridShape(dp=2), device_memory=2**30, ep_splits=experts), **kw
    )
    need = min(c.max_rank_memory_bytes for c in whole.ranked if c.expert_parallel_degree == 1)
    tight = PlanInputs(GridShape(dp=2), device_memory=need - 1, ep_splits=experts)
    best = search(profile, tight, **kw).best
    assert best.expert_parallel_degree == 2
    assert best.config()["expert_parallel_degree"] == 2


def _tiny_mixtral(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64,
    )  # fmt: skip
    config.architectures = ["MixtralForCausalLM"]
    config.to_json_file(str(path))
    return path


def test_cli_plan_ep_and_auto_on_a_mixtral_config(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    hf = ["--hf-config", str(_tiny_mixtral(tmp_path / "config.json")), "--seq-len", "16"]
    assert main(["plan", *hf, "--world-size", "4", "--ep", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["expert_parallel_degree"] == 2 and data["layout"]["data_parallel_degree"] == 4
    # 2 layers, 16 tokens, top-2, hidden 32, fp32: the documented formula, one microbatch
    pairs = 16 * 2
    layer = 2 * pairs * (1 / 2) * (2 * 32 * 4 + 4) + 1 * 2 * 8
    assert sum(data["ep_comm_bytes"]) == pytest.approx(2 * layer, rel=1e-6)
    assert main(["plan", *hf, "--world-size", "4", "--ep", "3"]) == 2
    assert "use an expert_parallel_degree in [1, 2, 4]" in capsys.readouterr().err
    auto = [
        "plan", "--auto", *hf, "--world-size", "4", "--device-memory", "1GiB",
        "--global-batch", "4", "--no-offload", "--no-bf16", "--no-checkpointing",
        "--max-virtual-stages", "1", "--top", "500", "--json",
    ]  # fmt: skip
    assert main(auto) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ep_degrees"] == [1, 2, 4]
    assert {c["expert_parallel_degree"] for c in data["candidates"]} == {1, 2, 4}
    assert data["plan"]["expert_parallel_degree"] == data["expert_parallel_degree"]
    assert main([*auto, "--ep", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["expert_parallel_degree"] for c in data["candidates"]} == {2}
    assert data["config"]["expert_parallel_degree"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_auto_plan_mixtral_8x7b_on_16_gpus_prints_an_ep_layout(capsys, monkeypatch):
    """The issue's case: Mixtral-8x7B on 16 x 80 GiB. With the all-to-alls inside one
    host's links (``--ep-bandwidth 150GB``) an ep layout is the best; at the default 10 GB/s
    ep layouts are listed behind ep = 1 ones (the all-to-alls cost more than they save)."""
    from mpar.cli import main

    pytest.importorskip("transformers")
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    argv = [
        "plan", "--auto", "--hf-config", str(MIXTRAL_8X7B), "--seq-len", "4096",
        "--world-size", "16", "--device-memory", "80GiB", "--global-batch", "64",
        "--device", "cuda", "--ep-bandwidth", "150GB", "--no-offload", "--max-virtual-stages", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[1].splitlines()
    assert " ep" in table[1], out  # the best row
    assert "expert parallel x" in out.split("best layout, stage by stage:")[1]
