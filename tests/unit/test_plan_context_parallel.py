"""Context parallelism in the planner (issue 41, Deliver 6): one CP rank's share of a
profile, the attention found in one forward, ``mpar plan --cp`` and the auto search.
The runtime's figures against these are calibrated in ``benchmarks/plan_accuracy.py``."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from mpar.cli import _plan
from mpar.errors import PartitionError
from mpar.partition import (
    AttentionCall,
    CPAttention,
    PlanInputs,
    SearchSpace,
    ZeroSetup,
    make_plan,
    measure_attention,
    search,
)
from mpar.partition._cp_share import cp_refusal, cp_share
from mpar.partition._search import CP_DOMINATED
from mpar.profile import ModelProfile, UnitProfile
from mpar.topology import GridShape

MIB = 2**20


def _unit(name: str, act: int = 64 * MIB) -> UnitProfile:
    return UnitProfile(
        name, 1000, 4000, 4000, 8000, 10**9, 0.010, act, act // 8, fixed_time_s=0.002
    )


def _profile() -> ModelProfile:
    return ModelProfile([_unit("embed"), _unit("layer.0"), _unit("layer.1"), _unit("head")],
                        "measure", "adam", 4000)  # fmt: skip


# 2 samples x 4096 tokens, 8 query heads and 2 key/value heads of 64 features
CALL = AttentionCall(tokens=2 * 4096, head_dim=64, q_heads=8, kv_heads=2)
ATTENTION = CPAttention({"layer.0": (CALL,), "layer.1": (CALL,)}, sequence=4096)


def test_a_cp_rank_keeps_its_share_of_what_grows_with_the_sequence():
    whole = _profile()
    share = cp_share(whole, ATTENTION, 4, "ring")
    for w, s in zip(whole.units, share.units):
        assert s.activation_bytes == w.activation_bytes // 4
        assert s.output_bytes == w.output_bytes // 4
        assert s.time_s == pytest.approx(0.002 + 0.008 / 4)  # the fixed part stays
        assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (4000, 4000, 8000)
    assert share.units[0].cp_comm_bytes == 0  # no attention in the embedding


def test_attention_traffic_follows_the_documented_formulas():
    per_head = 4 * 2 * 4096 * 64  # fp32 bytes of one head over the whole microbatch
    ring = cp_share(_profile(), ATTENTION, 4, "ring").units[1]
    kv = 2 * 2 * per_head  # K and V, 2 key/value heads
    assert ring.cp_comm_bytes == 2 * 3 / 4 * kv  # forward and again in the backward
    assert ring.cp_comm_fp32_bytes == kv  # dK, dV in float32, cp steps of S/cp
    a2a = cp_share(_profile(), ATTENTION, 4, "all_to_all").units[1]
    # 2 kv heads do not divide by 4: each rank takes its queries' copies (Hkv' = Hq)
    assert a2a.cp_comm_bytes == 2 * 3 / 16 * per_head * (2 * 8 + 2 * 8)
    assert a2a.cp_comm_fp32_bytes == 0
    a2a2 = cp_share(_profile(), ATTENTION, 2, "all_to_all").units[1]
    assert a2a2.cp_comm_bytes == 2 * 1 / 4 * per_head * (2 * 8 + 2 * 2)


def test_degrees_the_model_cannot_split_by_are_refused_with_the_reason():
    assert cp_refusal(ATTENTION, 1, "ring") is None
    assert "does not divide by 2 x cp" in cp_refusal(
        dataclasses.replace(ATTENTION, sequence=4100), 4, "ring"
    )
    three = CPAttention({"layer.0": (dataclasses.replace(CALL, q_heads=6),)}, 4096)
    assert "query heads" in cp_refusal(three, 4, "all_to_all")
    assert cp_refusal(three, 4, "ring") is None
    assert "no attention" in cp_refusal(CPAttention(), 2, "ring")
    with pytest.raises(PartitionError, match="cannot be planned: no attention"):
        cp_share(_profile(), None, 2)


def test_plan_at_cp2_halves_activations_and_shards_zero_over_dp_x_cp():
    base = PlanInputs(GridShape(pp=1, dp=1), zero=ZeroSetup(stage=1), cp_attention=ATTENTION)
    one = make_plan(_profile(), dataclasses.replace(base, grid=GridShape(pp=1, dp=2)))
    two = make_plan(_profile(), dataclasses.replace(base, grid=GridShape(pp=1, dp=1, cp=2)))
    assert two.stages[0].activation_bytes == one.stages[0].activation_bytes // 2
    assert two.stages[0].state_bytes == one.stages[0].state_bytes  # dp 2 or cp 2: 2 shards
    assert two.layout.data_parallel_degree == 2
    assert two.context_parallel_degree == 2 and two.context_parallel_method == "ring"
    ring = cp_share(_profile(), ATTENTION, 2).units
    assert two.cp_comm_bytes == [sum(u.cp_comm_bytes + u.cp_comm_fp32_bytes for u in ring)]
    assert two.stages[0].cp_comm_s == pytest.approx(two.cp_comm_bytes[0] / 10e9)
    assert "context parallel x2 (ring)" in str(two)
    with pytest.raises(PartitionError, match="needs cp_attention"):
        make_plan(_profile(), dataclasses.replace(base, grid=GridShape(cp=2), cp_attention=None))


def _llama(tmp_path, heads=4, kv_heads=2):
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": 128, "max_position_embeddings": 65536,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_attention_is_found_per_unit_with_its_key_value_heads(tmp_path):
    from mpar.cli._hf_model import build_hf_model
    from mpar.profile import profile_model

    module, kwargs = build_hf_model(_llama(tmp_path), seq_len=256, batch=2)
    profile = profile_model(module, (), kwargs, mode="meta")
    found = measure_attention(module, profile.units, (), kwargs)
    assert found.sequence == 256
    layers = [u for u in profile.names if u.startswith("model.layers.")]
    assert sorted(found.calls) == layers
    assert found.calls[layers[0]] == (AttentionCall(512, 16, 4, 2),)  # not the repeated 4


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    _plan.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_cli_plan_cp_predicts_one_cp_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    common = ["--hf-config", str(_llama(tmp_path)), "--seq-len", "2048", "--device", "cuda"]
    plans = {}
    for cp in (1, 2):
        argv = [*common, "--world-size", "2", "--cp", str(cp), "--json"]
        assert _run_cli(argv) == 0, capsys.readouterr().err
        plans[cp] = json.loads(capsys.readouterr().out)
    one, two = plans[1], plans[2]
    assert two["context_parallel_degree"] == 2 and one["num_ranks"] == 2  # cp 1: pp 2
    assert two["cp_comm_bytes"][0] > 0 and not one["cp_comm_bytes"][0]
    act = [sum(s["activation_bytes"] for s in p["stages"]) for p in (one, two)]
    assert act[1] == pytest.approx(act[0] / 2, rel=0.01)
    assert _run_cli([*common, "--world-size", "2", "--cp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def _auto(tmp_path, monkeypatch, capsys, seq, memory, *extra):
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    argv = [*extra, "--auto", "--hf-config", str(_llama(tmp_path)), "--seq-len", str(seq),
            "--world-size", "2", "--global-batch", "2", "--device", "cuda",
            "--device-memory", memory, "--no-bf16", "--no-checkpointing", "--json"]  # fmt: skip
    assert _run_cli(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_auto_picks_cp_where_one_sequence_overflows_the_cap(tmp_path, monkeypatch, capsys):
    """8192 tokens: one sample's activations (about 1 GiB a layer in the meta profile,
    2 layers) overflow 1.5 GiB on every layout that keeps a whole sequence on a rank
    (dp 2: both layers; pp 2: one layer, two microbatches in flight). TP is left out:
    on --device cuda's cluster preset (h100, 450 GB/s in a node) tp 2 halves the
    activations of its split regions too and fits first."""
    out = _auto(tmp_path, monkeypatch, capsys, 8192, "1.5GiB", "--tp", "1")
    assert out["context_parallel_degree"] == 2
    assert out["config"]["context_parallel_degree"] == 2
    assert out["cp_degrees"] == [1, 2]


def test_auto_keeps_cp_1_where_it_only_costs(tmp_path, monkeypatch, capsys):
    """Under a cap nothing overflows, data parallelism splits the batch without the
    attention traffic; a short sequence is not searched for cp at all."""
    roomy = _auto(tmp_path, monkeypatch, capsys, 8192, "64GiB")
    assert roomy["cp_degrees"] == [1, 2]
    assert roomy["context_parallel_degree"] == 1
    short = _auto(tmp_path, monkeypatch, capsys, 512, "64GiB")
    assert short["cp_degrees"] == [1] and short["context_parallel_degree"] == 1


def test_search_space_can_fix_the_cp_degree():
    base = PlanInputs(GridShape(dp=4), device_memory=2**40, cp_attention=ATTENTION)
    space = SearchSpace(context_parallel_degrees=(4,), zero_stages=(0,), precisions=("fp32",))
    result = search(_profile(), base, global_batch=1, space=space, top=2)
    assert {c.context_parallel_degree for c in result.ranked} == {4}
    with pytest.raises(PartitionError, match="does not divide"):
        search(
            _profile(),
            base,
            global_batch=1,
            space=dataclasses.replace(space, context_parallel_degrees=(3,)),
        )


def _cp_twin(c: dict[str, object]) -> tuple[object, ...]:
    """What a layout keeps when cp folds into dp (the layout at cp 1 and dp x cp)."""
    dp = int(c["data_parallel_degree"]) * int(c["context_parallel_degree"])  # type: ignore[call-overload]
    keep = ("pipeline_parallel_degree", "microbatches", "pipeline", "virtual_stages",
            "zero_stage", "offload_optimizer", "offload_params", "activation_checkpointing",
            "precision", "tensor_parallel_degree")  # fmt: skip
    return (dp, *(c[k] for k in keep))


def test_search_skips_cp_over_whole_samples_as_dominated_by_cp_1():
    """At cp > 1 with whole samples per microbatch (cp divides the microbatch size), the
    layout at cp 1 with dp x cp holds the same bytes and is faster (no attention
    traffic): the search counts those layouts and lays none out, and ranks the rest as
    the search that lays out every cp degree does."""
    base = PlanInputs(GridShape(dp=4), device_memory=2**40, cp_attention=ATTENTION)
    space = SearchSpace(zero_stages=(0, 1), precisions=("fp32",), checkpointing=(False,))
    free = search(_profile(), base, global_batch=8, space=space, top=10_000)
    fixed = dataclasses.replace(space, context_parallel_degrees=(1, 2, 4))
    every = search(_profile(), base, global_batch=8, space=fixed, top=10_000)
    rows = [c.to_dict() for c in every.ranked]
    dominated = [c for c in rows if c["microbatch_size"] % c["context_parallel_degree"] == 0
                 and c["context_parallel_degree"] > 1]  # fmt: skip
    assert len(dominated) == 45  # the pinned count of skipped layouts
    twins = {_cp_twin(c): c for c in rows if c["context_parallel_degree"] == 1}
    for c in dominated:
        twin = twins[_cp_twin(c)]
        assert twin["max_rank_memory_bytes"] == c["max_rank_memory_bytes"]
        assert twin["step_time_s"] < c["step_time_s"]
    assert free.rejected[CP_DOMINATED] == len(dominated)
    assert free.evaluated == every.evaluated - len(dominated)
    assert [c.to_dict() for c in free.ranked] == [c for c in rows if c not in dominated]
    best = search(_profile(), base, global_batch=8, space=space, top=3)
    assert [c.to_dict() for c in best.ranked] == rows[:3]
