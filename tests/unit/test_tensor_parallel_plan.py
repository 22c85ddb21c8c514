"""Tensor-parallel plans: matching, checks at wrap time, and how parameters are split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpar.config import load_config
from mpar.errors import ConfigError
from mpar.tensor_parallel import (
    SequenceParallelError,
    TPPlanError,
    TPShard,
    apply_layout,
    match_plan,
    parse_style,
    plan_layout,
    resolve_plan,
    sequence_parallel_on,
)
from mpar.testing.models import GPT_TP_PLAN, GPTConfig, TinyGPT


def _gpt(**kw):
    cfg = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=4, d_ffn=32, max_seq_len=8)
    return TinyGPT(GPTConfig(**{**cfg, "fused_qkv": False, **kw}))


def test_patterns_match_one_component_and_suffixes():
    model = _gpt()
    plan, _ = resolve_plan(model, {"blocks.*.q": "colwise", "mlp.0": "colwise"})
    found = match_plan(model, plan)
    assert sorted(found) == ["blocks.0.mlp.0", "blocks.0.q", "blocks.1.mlp.0", "blocks.1.q"]
    assert not match_plan(model, resolve_plan(model, {"blocks.q": "colwise"})[0])


def test_layout_splits_and_replicates():
    model = _gpt()
    plan, source = resolve_plan(model, GPT_TP_PLAN)
    layout = plan_layout(model, plan, 2, source)
    assert layout.shards["blocks.0.q.weight"] == TPShard(0, 2)
    assert layout.shards["blocks.0.q.bias"] == TPShard(0, 2)
    assert layout.shards["blocks.0.proj.weight"] == TPShard(1, 2)
    assert "blocks.0.proj.bias" not in layout.shards  # rowwise bias: added once, whole
    assert "wte.weight" not in layout.shards and "blocks.0.ln_1.weight" not in layout.shards


def test_packed_shard_round_trip():
    full = torch.arange(24.0).reshape(12, 2)  # three blocks (q|k|v) of 4 rows
    shard = TPShard(0, 2, packs=3)
    pieces = [shard.local(full, r) for r in range(2)]
    assert pieces[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert torch.equal(shard.assemble(pieces), full)
    assert shard.boxes(full.shape, 1) == [(2, 2), (6, 2), (10, 2)]


def test_heads_not_divisible_is_a_clear_error():
    model = _gpt(num_heads=2, d_model=16)
    plan, source = resolve_plan(model, GPT_TP_PLAN)
    with pytest.raises(
        TPPlanError, match=r"num_heads is 2, not divisible by tensor_parallel_degree 4"
    ):
        plan_layout(model, plan, 4, source)


def test_sizes_not_divisible_name_the_parameter():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    plan, source = resolve_plan(model, {"0": "colwise", "1": "rowwise"})
    with pytest.raises(TPPlanError, match=r"0.weight: dimension 0 of shape \(6, 4\) has 6"):
        plan_layout(model, plan, 4, source)


def test_model_without_plan():
    with pytest.raises(TPPlanError, match="has no tensor-parallel plan.*tp_plan"):
        resolve_plan(nn.Sequential(nn.Linear(2, 2)), None)


def test_plan_matching_nothing():
    model = _gpt()
    plan, source = resolve_plan(model, {"layers.*.q_proj": "colwise"})
    with pytest.raises(TPPlanError, match="1 of its 1 patterns match no module"):
        plan_layout(model, plan, 2, source)


def test_tied_weight_split_on_one_side_only():
    model = _gpt()  # head.weight is wte.weight
    plan, source = resolve_plan(model, {"head": "colwise"})
    with pytest.raises(TPPlanError, match="shared with wte.weight"):
        plan_layout(model, plan, 2, source)


def test_unsupported_module_type():
    model = nn.Sequential(nn.LayerNorm(4))
    plan, source = resolve_plan(model, {"0": "colwise"})
    with pytest.raises(TPPlanError, match="LayerNorm cannot take"):
        plan_layout(model, plan, 2, source)


@pytest.mark.parametrize("bad", ["columnwise", "packed_colwise:x", "sequence_parallel:2"])
def test_unknown_style(bad):
    with pytest.raises(TPPlanError, match="tensor-parallel style|packed_colwise"):
        parse_style(bad, "entry")
    with pytest.raises(ConfigError):
        load_config({"tp_plan": {"a": bad}})


def test_config_keys_and_world_size():
    cfg = load_config({"tp": 2, "tp_plan": {"blocks.*.q": "colwise"}})
    assert cfg.tensor_parallel_degree == 2
    cfg.check_world_size(4)
    with pytest.raises(ConfigError, match="do not divide the world size 6"):
        load_config({"tp": 4}).check_world_size(6)
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):
        load_config({"tensor_parallel_degree": 0})
    with pytest.raises(TypeError, match="tp_plan"):
        load_config({"tp_plan": ["colwise"]})
    with pytest.raises(ConfigError, match="cpu and cuda only"):
        load_config({"tp": 2, "device": "xla"})
    with pytest.raises(ConfigError, match="alias"):
        load_config({"tp": 2, "tensor_parallel_degree": 2})


def test_hf_plans_resolve():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )
    plan, source = resolve_plan(llama, None)
    assert "base_model_tp_plan" in source
    layout = plan_layout(llama, plan, 2, source)
    assert layout.shards["model.layers.0.self_attn.k_proj.weight"] == TPShard(0, 2)
    with pytest.raises(TPPlanError, match="num_key_value_heads is 2"):
        plan_layout(llama, plan, 4, source)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4))
    plan, source = resolve_plan(gpt2, None)
    layout = plan_layout(gpt2, plan, 2, source)
    assert layout.shards["transformer.h.0.attn.c_attn.weight"] == TPShard(1, 2, packs=3)
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
        )
    )
    plan, source = resolve_plan(opt, None)
    assert source == "mpar's plan for 'opt' models"
    layout = plan_layout(opt, plan, 2, source)
    assert layout.shards["model.decoder.layers.0.fc2.weight"] == TPShard(1, 2)


def test_hf_per_head_norms_keep_their_weights_and_sum_their_gradients():
    """Qwen3's own plan names q_norm / k_norm "replicated_with_grad_allreduce" (before:
    an unknown style); they stay whole, their gradients summed over TP."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64)
    qwen3 = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**small, num_hidden_layers=1, num_key_value_heads=2, head_dim=8)
    )
    plan, source = resolve_plan(qwen3, None)
    layout = plan_layout(qwen3, plan, 2, source)
    assert layout.summed == {
        "model.layers.0.self_attn.q_norm": ("weight",),
        "model.layers.0.self_attn.k_norm": ("weight",),
    }
    assert "model.layers.0.self_attn.q_norm.weight" not in layout.shards


@pytest.mark.parametrize(
    "shard", [TPShard(0, 2), TPShard(1, 2), TPShard(1, 2, packs=3), TPShard(0, 4)]
)
def test_full_runs_place_every_held_element(shard):
    from mpar.meta._owned import Share, full_runs

    whole = torch.arange(12 * 12).reshape(12, 12)
    for rank in range(shard.size):
        piece = shard.local(whole, rank).reshape(-1)
        share = Share("w", piece, whole.shape, 0, split=shard)
        for start, stop in [(0, piece.numel()), (5, 31)]:
            flat = whole.reshape(-1).clone().zero_()
            for first, run in full_runs(share, rank, start, piece[start:stop]):
                flat[first : first + run.numel()] = run
            placed = flat != 0
            assert torch.equal(flat[placed], whole.reshape(-1)[placed])
            assert int(placed.sum()) == stop - start - int((piece[start:stop] == 0).sum())


# -- sequence parallelism -------------------------------------------------------------


def test_sequence_parallel_layout_of_the_test_gpt():
    model = _gpt()
    plan, source = resolve_plan(model, GPT_TP_PLAN)
    seq = plan_layout(model, plan, 2, source, sequence_parallel=True).sequence
    assert seq is not None
    assert seq.lists == [["blocks.0", "blocks.1"]]
    # q/k/v sit in the block itself: each gathers; the MLP gathers once
    assert seq.gathers == ["blocks.0.k", "blocks.0.mlp", "blocks.0.q", "blocks.0.v"] + [
        "blocks.1.k",
        "blocks.1.mlp",
        "blocks.1.q",
        "blocks.1.v",
    ]
    assert seq.scattered == {"blocks.0.proj", "blocks.0.mlp.2", "blocks.1.proj", "blocks.1.mlp.2"}
    assert seq.summed["blocks.0.ln_1"] == ("weight", "bias")
    assert "blocks.0.proj" not in seq.summed  # the rowwise forward sums its bias's gradient
    assert plan_layout(model, plan, 2, source).sequence is None


def test_sequence_parallel_style_is_accepted():
    model = _gpt()
    plan, _ = resolve_plan(model, {**GPT_TP_PLAN, "blocks.*.ln_1": "sequence_parallel"})
    assert parse_style("sequence_parallel", "entry").kind == "sequence_parallel"
    assert "blocks.0.ln_1" not in match_plan(model, plan)  # nothing split
    assert sequence_parallel_on(plan, "speed")  # the entry turns it on, as optimize 'memory'
    assert sequence_parallel_on(resolve_plan(model, GPT_TP_PLAN)[0], "memory")
    assert not sequence_parallel_on(resolve_plan(model, GPT_TP_PLAN)[0], "speed")


def test_sequence_parallel_needs_a_block_list():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    plan, source = resolve_plan(model, {"0": "colwise", "1": "rowwise"})
    with pytest.raises(SequenceParallelError, match="no nn.ModuleList of blocks.*optimize 'speed'"):
        plan_layout(model, plan, 2, source, sequence_parallel=True)


def test_sequence_parallel_refuses_an_unsplit_attention():
    model = _gpt()  # only the MLP planned: q, k, v whole would attend to 1/tp of the tokens
    plan, source = resolve_plan(model, {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})
    with pytest.raises(SequenceParallelError, match=r"module blocks.0.q \(Linear\) in block"):
        plan_layout(model, plan, 2, source, sequence_parallel=True)


def test_sequence_length_not_divisible():
    model = _gpt()
    plan, source = resolve_plan(model, GPT_TP_PLAN)
    layout = plan_layout(model, plan, 2, source, sequence_parallel=True)
    apply_layout(model, layout, 0, "unregistered")  # the check comes before any collective
    with pytest.raises(SequenceParallelError, match="length 7 is not divisible by 2"):
        model(torch.zeros(1, 7, dtype=torch.long))


def test_hf_models_sequence_parallel_layout():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )
    plan, source = resolve_plan(llama, None)
    seq = plan_layout(llama, plan, 2, source, sequence_parallel=True).sequence
    assert seq.lists == [["model.layers.0", "model.layers.1"]]
    assert seq.gathers[:2] == ["model.layers.0.mlp", "model.layers.0.self_attn"]
    assert seq.summed["model.layers.0.input_layernorm"] == ("weight",)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2)
    )
    plan, source = resolve_plan(t5, None)
    seq = plan_layout(t5, plan, 2, source, sequence_parallel=True).sequence
    assert [blocks[0] for blocks in seq.lists] == ["encoder.block.0", "decoder.block.0"]
    assert "decoder.block.0.layer.1.EncDecAttention" in seq.gathers


# -- every pattern, head counts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "closest"),
    [("blocks.*.mlp.O", "'blocks.*.mlp.0'"), ("prj", "'proj'"), ("mlp.O", "'mlp.0'")],
)
def test_a_misspelt_pattern_is_named_with_the_closest_names(typo, closest):
    # Before: accepted while other patterns matched; the first step died in torch.
    model = _gpt()
    plan = {k: v for k, v in GPT_TP_PLAN.items() if not k.startswith("blocks.*.mlp.2")}
    plan[typo] = "rowwise"
    styles, source = resolve_plan(model, plan)
    with pytest.raises(
        TPPlanError, match=rf"1 of its 6 patterns .* {typo!r} \(closest: .*{closest}"
    ):
        plan_layout(model, styles, 2, source)


def test_a_model_plan_may_name_modules_its_configuration_lacks():
    model = _gpt()  # as T5's plan names wi and wi_0: only the user's plan must match whole
    styles, _ = resolve_plan(model, {**GPT_TP_PLAN, "blocks.*.wi": "colwise"})
    layout = plan_layout(model, styles, 2, "mpar's plan for 'gpt' models")
    assert "blocks.0.q" in layout.modules


class _Attention(nn.Module):
    """Attention keeping its head count in ``nh`` (not a name mpar divides), or in
    ``heads_attr``; ``reshape="head_dim"`` takes the heads from the tensor instead."""

    def __init__(self, d: int = 16, nh: int = 4, reshape: str = "nh", heads_attr: str = "nh"):
        super().__init__()
        setattr(self, heads_attr, nh)
        self.heads_attr, self.head_dim, self.reshape = heads_attr, d // nh, reshape
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads = getattr(self, self.heads_attr)
        shape = (b, t, heads, -1) if self.reshape == "nh" else (b, t, -1, self.head_dim)
        q, k, v = (m(x).view(shape).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(att.transpose(1, 2).flatten(2))


class _Net(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attention(**kw) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


_ATTN_PLAN = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise"}
_ATTN_PLAN |= {"blocks.*.o": "rowwise"}


@pytest.mark.parametrize("meta", [False, True])
def test_a_head_count_mpar_cannot_establish_is_refused(meta):
    # Before: split silently; tp=2 trained with losses 3e-3 off one process.
    with torch.device("meta" if meta else "cpu"):
        model = _Net()
    styles, source = resolve_plan(model, _ATTN_PLAN)
    with pytest.raises(
        TPPlanError, match=r"blocks.0 \(_Attention\) computes .* over 2 elements .* 4.*'nh': 4"
    ) as info:
        plan_layout(model, styles, 2, source)
    assert "num_heads" in str(info.value) and "view(b, t, -1, self.head_dim)" in str(info.value)
    assert "forward" not in model.blocks[0].q.__dict__  # the probe left the modules as they were


def test_heads_taken_from_the_tensor_pass_the_probe():
    model = _Net(reshape="head_dim")
    styles, source = resolve_plan(model, _ATTN_PLAN)
    layout = plan_layout(model, styles, 2, source)
    assert layout.shards["blocks.1.o.weight"] == TPShard(1, 2)


def test_a_head_count_attribute_mpar_knows_needs_no_probe():
    model = _Net(heads_attr="num_heads")  # divided by the TP degree when applied
    styles, source = resolve_plan(model, _ATTN_PLAN)
    plan_layout(model, styles, 2, source)


class _TwoInputs(_Attention):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * scale


def test_a_module_the_probe_cannot_run_is_refused_when_it_holds_a_possible_head_count():
    model = nn.ModuleDict({"blocks": nn.ModuleList([_TwoInputs()])})
    styles, source = resolve_plan(model, _ATTN_PLAN)
    with pytest.raises(TPPlanError, match=r"\{'nh': 4\}.*could not run on a probe input"):
        plan_layout(model, styles, 2, source)
    model = nn.ModuleDict({"blocks": nn.ModuleList([_TwoInputs(reshape="head_dim")])})
    del model.blocks[0].nh  # nothing left that could count heads: the tensors do
    plan_layout(model, styles, 2, source)
