"""The planner under tensor parallelism: one TP rank's memory, TP communication, tp in
the ``--auto`` search, and ``mpar plan --tp`` (pure: profiles on the meta device)."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import textwrap

import pytest
import torch

from mpar.errors import PartitionError
from mpar.partition import CostModel, PlanInputs, ScheduleSetup, SearchSpace, make_plan, search
from mpar.partition._search import NO_TP_PLAN, TP_REFUSED
from mpar.partition._tp_share import TPSplits, tp_share
from mpar.profile import profile_model
from mpar.tensor_parallel import tp_splits
from mpar.testing.models import GPT_TP_PLAN, GPTConfig, TinyGPT
from mpar.topology import GridShape

B, T = 2, 16


def _base(world: int, memory: int, splits: TPSplits | None = None) -> PlanInputs:
    """What the search starts from: ``world`` ranks with ``memory`` bytes each."""
    return PlanInputs(GridShape(dp=world), device_memory=memory, tp_splits=splits)


@functools.lru_cache(maxsize=8)
def _gpt(**kw):
    """A meta TinyGPT, its config, one microbatch and its profile (shared: none mutates it)."""
    cfg = GPTConfig(fused_qkv=False, **kw)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    x = torch.zeros(B, T, dtype=torch.long)
    return model, cfg, x, profile_model(model, (x,), mode="meta")


def _splits(model, profile, x, degrees=(2,), plan=GPT_TP_PLAN):
    return tp_splits(model, profile, ((x,), {}), degrees, user_plan=plan)


def _block_params(cfg):
    """(split, replicated) parameter counts of one block under GPT_TP_PLAN."""
    d, f = cfg.d_model, cfg.d_ffn
    split = 3 * (d * d + d) + d * d + (d * f + f) + f * d  # q k v, proj W, mlp.0, mlp.2 W
    replicated = 2 * 2 * d + d + d  # two layer norms, proj and mlp.2 biases
    return split, replicated


def test_split_parameters_and_their_state_halve_replicated_ones_do_not():
    model, cfg, x, profile = _gpt()
    half = tp_share(profile, _splits(model, profile, x), 2)
    split, replicated = _block_params(cfg)
    for whole, rank in zip(profile.units, half.units):
        if whole.name.startswith("blocks."):
            assert whole.param_count == split + replicated
            assert rank.param_count == split // 2 + replicated
            assert rank.param_bytes == 4 * (split // 2 + replicated)
            assert rank.grad_bytes == 4 * (split // 2 + replicated)
            assert rank.optimizer_bytes == 8 * (split // 2 + replicated)  # Adam
        else:  # embeddings, final norm, tied head: replicated
            assert (rank.param_bytes, rank.grad_bytes) == (whole.param_bytes, whole.grad_bytes)
            assert rank.optimizer_bytes == whole.optimizer_bytes
            assert rank.activation_bytes == whole.activation_bytes
            assert rank.tp_comm_bytes == 0
    assert tp_share(profile, _splits(model, profile, x), 1) is profile


def test_activations_split_inside_split_regions_only():
    model, _cfg, x, profile = _gpt()
    half = tp_share(profile, _splits(model, profile, x), 2)
    block, rank = profile.units[2], half.units[2]
    # the colwise inputs and rowwise outputs stay whole: more than half remains
    assert block.activation_bytes / 2 < rank.activation_bytes < block.activation_bytes


def test_plan_at_tp2_counts_one_rank_and_the_all_reduces():
    model, cfg, x, profile = _gpt(num_layers=4)
    splits = _splits(model, profile, x)
    m, bandwidth = 4, 1e9
    cost = CostModel(tp_bandwidth=bandwidth)
    run = PlanInputs(GridShape(pp=2), ScheduleSetup(microbatches=m))
    one = make_plan(profile, run, cost=cost)
    two = make_plan(
        profile, dataclasses.replace(run, grid=GridShape(pp=2, tp=2), tp_splits=splits), cost=cost
    )
    split, _ = _block_params(cfg)
    saved = (4 + 4 + 8) * split // 2  # params, grads, Adam's 2 moments: half the split ones
    state = sum(s.state_bytes for s in one.stages) - sum(s.state_bytes for s in two.stages)
    assert state == cfg.num_layers * saved
    assert max(two.rank_memory_bytes) < max(one.rank_memory_bytes)
    # per block and microbatch: 2 forward all-reduces (proj, mlp.2) and 4 backward ones (the
    # gradients of the inputs of q, k, v, mlp.0), each of the (B, T, d) activation; a ring
    # all-reduce sends 2 (tp - 1) / tp of it per rank
    activation = B * T * cfg.d_model * 4
    assert sum(two.tp_comm_bytes) == m * cfg.num_layers * 6 * activation
    for stage in two.stages:
        blocks = sum(u.startswith("blocks.") for u in stage.units)
        assert stage.tp_comm_s == pytest.approx(blocks * 6 * activation / bandwidth)
    assert two.tensor_parallel_degree == 2 and two.to_dict()["tensor_parallel_degree"] == 2
    assert "tensor parallel x2" in str(two)
    with pytest.raises(PartitionError, match="tp_splits"):
        make_plan(profile, PlanInputs(GridShape(pp=2, tp=2)))


def test_search_lists_tp_degrees_the_plan_accepts():
    model, _cfg, x, profile = _gpt(num_heads=2)  # tp 4 splits no head evenly
    splits = _splits(model, profile, x, degrees=(2, 4))
    assert splits.degrees == (1, 2) and "num_heads" in splits.refused[4]
    space = SearchSpace(
        pipelines=("interleaved",), zero_stages=(0,), offload=False, checkpointing=(False,),
        precisions=("fp32",), max_virtual_stages=1,
    )  # fmt: skip
    result = search(
        profile, _base(4, 2**30, splits), global_batch=8, profile_batch=B, space=space, top=1000
    )
    assert {c.tensor_parallel_degree for c in result.ranked} == {1, 2}
    assert result.rejected[TP_REFUSED] == 1
    assert any("tp 4 left out" in n for n in result.notes)
    for c in result.ranked:
        tp = c.tensor_parallel_degree
        assert c.pipeline_parallel_degree * c.data_parallel_degree * tp == 4
        assert c.config()["tensor_parallel_degree"] == tp
    assert "pp x dp x tp" in str(result)


def test_search_needs_tp_when_only_a_tp_rank_fits():
    model, _cfg, x, profile = _gpt(num_layers=2, d_model=64, d_ffn=1024)
    splits = _splits(model, profile, x, degrees=(2,))
    space = SearchSpace(pipeline_degrees=(1,), zero_stages=(0,), offload=False)
    kw = {"global_batch": 2, "profile_batch": B, "space": space, "headroom": 0.0}
    whole = search(profile, _base(2, 2**30, splits), **kw, top=1000)  # every fitting layout
    need = min(c.max_rank_memory_bytes for c in whole.ranked if c.tensor_parallel_degree == 1)
    tight = search(profile, _base(2, need - 1, splits), **kw)
    assert tight.best.tensor_parallel_degree == 2
    assert tight.to_dict()["config"]["tensor_parallel_degree"] == 2


def test_search_without_a_plan_keeps_tp_1():
    model, _cfg, x, profile = _gpt()
    none = tp_splits(model, profile, ((x,), {}), (2, 4))  # TinyGPT ships no plan
    assert none.degrees == (1,) and "no tensor-parallel plan" in none.source
    space = SearchSpace(zero_stages=(0,), offload=False, checkpointing=(False,))
    result = search(profile, _base(4, 2**30, none), global_batch=8, space=space)
    assert {c.tensor_parallel_degree for c in result.ranked} == {1}
    assert result.rejected[NO_TP_PLAN] == 2
    assert result.to_dict()["tp_degrees"] == [1]
    with pytest.raises(PartitionError, match="tensor_parallel_degree 2"):
        tp_share(profile, TPSplits.none(), 2)


def _factory(tmp_path, monkeypatch):
    (tmp_path / "tp_factory_mod.py").write_text(
        textwrap.dedent(
            """
            import types
            import torch
            from mpar.testing.models import GPT_TP_PLAN, GPTConfig, TinyGPT

            def make():
                model = TinyGPT(GPTConfig(num_layers=2, fused_qkv=False))
                return model, torch.zeros(2, 8, dtype=torch.long)

            def planned():  # a model carrying its own plan, as Hugging Face's do
                model, x = make()
                model.config = types.SimpleNamespace(base_model_tp_plan=GPT_TP_PLAN)
                return model, x
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_cli_plan_tp_json_and_config_key(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    _factory(tmp_path, monkeypatch)
    base = ["plan", "--meta", "--world-size", "4", "--json"]
    assert main([*base, "--model", "tp_factory_mod:planned", "--tp", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_parallel_degree"] == 2 and data["num_ranks"] == 2
    assert data["layout"]["data_parallel_degree"] == 1 and min(data["tp_comm_bytes"]) > 0
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"partitions": 1, "tp": 2, "tp_plan": GPT_TP_PLAN}))
    assert main([*base, "--model", "tp_factory_mod:make", "--config", str(cfg)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_parallel_degree"] == 2 and data["layout"]["data_parallel_degree"] == 2
    assert main([*base, "--model", "tp_factory_mod:make", "--tp", "2"]) == 2
    assert "no tensor-parallel plan" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "tp_factory_mod", raising=False)


def test_cli_plan_auto_json_says_tp(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    _factory(tmp_path, monkeypatch)
    argv = [
        "plan", "--auto", "--model", "tp_factory_mod:planned", "--meta", "--world-size", "2",
        "--device-memory", "1GiB", "--global-batch", "4", "--no-offload", "--no-bf16",
        "--no-checkpointing", "--top", "200", "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp_degrees"] == [1, 2]
    assert {c["tensor_parallel_degree"] for c in data["candidates"]} == {1, 2}
    assert data["config"]["tensor_parallel_degree"] == data["tensor_parallel_degree"]
    assert data["plan"]["tensor_parallel_degree"] == data["tensor_parallel_degree"]
    assert main([*argv, "--tp", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["tensor_parallel_degree"] for c in data["candidates"]} == {2}
    monkeypatch.delitem(sys.modules, "tp_factory_mod", raising=False)


def test_a_hf_causal_lm_splits_its_embedding_and_head_by_the_vocabulary():
    """With no tp_plan, a Hugging Face causal LM's token embedding and LM head are split
    by the vocabulary at tp = 2 (issue 44): one TP rank's share counts half of them."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(B, T, dtype=torch.long)
    profile = profile_model(model, (), {"input_ids": ids}, mode="meta")
    splits = tp_splits(model, profile, ((), {"input_ids": ids}), (2, 3))
    assert 3 in splits.refused  # 4 heads do not split 3 ways (nor 128 rows)
    half = {u.name: u for u in tp_share(profile, splits, 2).units}
    whole = {u.name: u for u in profile.units}
    table = 128 * 32  # embedding rows x features; the head is the same shape
    for unit in ("model.embed_tokens", "lm_head"):
        assert whole[unit].param_count == table
        assert half[unit].param_count == table // 2, unit
        assert half[unit].optimizer_bytes == whole[unit].optimizer_bytes // 2, unit
