"""Profiles: parameter/optimizer bytes, FLOPs, saved activations, meta mode."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from mpar.profile import profile_mode, profile_model
from mpar.testing.models import GPTConfig, TinyGPT, gpt_param_count


def test_linear_stack_counts():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = torch.randn(5, 8)
    prof = profile_model(model, (x,), optimizer="adam", repeats=2, warmup=1)
    first, relu, last = prof.units
    assert [u.name for u in prof.units] == ["0", "1", "2"]
    assert first.param_count == 8 * 16 + 16
    assert first.param_bytes == first.grad_bytes == 4 * first.param_count
    assert first.optimizer_bytes == 8 * first.param_count
    # forward 2*m*n*k, backward twice that (weight grad; no input grad: x needs none? it does here)
    assert first.flops >= 2 * 5 * 8 * 16 * 2
    assert last.flops == 3 * 2 * 5 * 16 * 4
    assert first.output_bytes == 5 * 16 * 4
    assert relu.activation_bytes == 5 * 16 * 4  # relu saves its output
    assert last.activation_bytes == 5 * 16 * 4  # the input, not the weight
    assert all(u.time_s > 0 for u in prof.units)
    assert prof.param_count == sum(u.param_count for u in prof.units)
    assert all(p.grad is None for p in model.parameters())


def test_weight_work_is_each_trainable_linears_input_and_output():
    """What a split backward keeps from I to W: each linear layer's input (once per
    storage) and its output's size (the output gradient), also for ``F.linear`` called
    on a parameter directly; a frozen layer keeps none."""
    block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))
    block[3].weight.requires_grad_(False)
    block[3].bias.requires_grad_(False)
    model = nn.Sequential(block, _Twice(nn.Linear(4, 4)), _Functional())
    prof = profile_model(model, (torch.randn(5, 8),), repeats=1, warmup=0)
    first, second, third = prof.units
    assert first.weight_work_bytes == 4 * 5 * ((8 + 16) + (16 + 4))
    assert second.weight_work_bytes == 4 * 5 * (4 + 4 + 4)  # one input, two calls
    assert third.weight_work_bytes == 4 * 5 * (4 + 6)
    # the meta profile sees the same shapes
    with torch.device("meta"):
        meta_model = nn.Sequential(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), nn.Linear(4, 2)
        )
    meta = profile_model(meta_model, (torch.randn(5, 8),), mode="meta", flops_per_second=1e9)
    assert [u.weight_work_bytes for u in meta.units] == [4 * 5 * (24 + 20), 4 * 5 * (4 + 2)]


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class _Twice(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + self.layer(x)


@pytest.mark.parametrize(("optimizer", "per_param"), [("sgd", 4), ("none", 0)])
def test_optimizer_bytes(optimizer, per_param):
    model = nn.Sequential(nn.Linear(4, 4))
    prof = profile_model(model, (torch.randn(2, 4),), optimizer=optimizer, repeats=1, warmup=0)
    assert prof.units[0].optimizer_bytes == per_param * 20


def test_tied_parameters_count_once():
    cfg = GPTConfig(num_layers=2, tie_embeddings=True)
    prof = profile_model(TinyGPT(cfg), (torch.randint(0, 128, (2, 8)),), repeats=1, warmup=0)
    by_name = {u.name: u for u in prof.units}
    assert by_name["head"].param_count == 0
    assert by_name["head"].tied_state_bytes == {"wte": 128 * 32 * 16}
    assert prof.param_count == gpt_param_count(cfg)


def test_meta_mode_matches_measure_mode_except_time():
    cfg = GPTConfig(num_layers=2)
    idx = torch.randint(0, 128, (2, 8))
    real = profile_model(TinyGPT(cfg), (idx,), repeats=1, warmup=0)
    with torch.device("meta"):
        meta_model = TinyGPT(cfg)
    meta = profile_model(meta_model, (idx,), mode="meta", flops_per_second=1e9)
    for a, b in zip(real.units, meta.units):
        assert (a.name, a.param_bytes, a.output_bytes) == (b.name, b.param_bytes, b.output_bytes)
        # attention picks a different kernel (and FLOP formula) on CPU than on meta
        assert b.flops == pytest.approx(a.flops, rel=0.1)
        assert b.activation_bytes == pytest.approx(a.activation_bytes, rel=0.5)
        assert b.time_s == pytest.approx(b.flops / 1e9)


def test_meta_mode_traces_each_kind_of_block_once(monkeypatch):
    """Identical blocks (same modules, parameters and inputs) take the first one's
    figures; a block that differs (here: a wider MLP) is traced on its own."""
    from mpar.profile import _profile as module

    cfg = GPTConfig(num_layers=4)
    with torch.device("meta"):
        model = TinyGPT(cfg)
        model.blocks[3].mlp[0] = nn.Linear(cfg.d_model, 8 * cfg.d_model)
        model.blocks[3].mlp[2] = nn.Linear(8 * cfg.d_model, cfg.d_model)
    idx = torch.randint(0, 128, (2, 8))
    traced: list[str] = []
    real_profile_unit = module._profile_unit
    monkeypatch.setattr(
        module, "_profile_unit", lambda m, n, *a: traced.append(n) or real_profile_unit(m, n, *a)
    )
    cached = profile_model(model, (idx,), mode="meta")
    assert [n for n in traced if "blocks" in n] == ["blocks.0", "blocks.3"]
    monkeypatch.setattr(module, "_unit_key", lambda *a: None)
    assert cached == profile_model(model, (idx,), mode="meta")


def test_meta_mode_on_a_real_model_runs_nothing_and_matches_the_meta_model():
    from torch._subclasses.fake_tensor import FakeTensor

    cfg = GPTConfig(num_layers=2)
    idx = torch.randint(0, 128, (2, 8))
    model = TinyGPT(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real_runs = []
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda m, args: real_runs.append(not isinstance(args[0], FakeTensor))
        )
    got = profile_model(model, (idx,), mode="meta", flops_per_second=1e9)
    assert real_runs and not any(real_runs)  # the blocks ran, on fake tensors only
    with torch.device("meta"):
        meta_model = TinyGPT(cfg)
    want = profile_model(meta_model, (idx,), mode="meta", flops_per_second=1e9)
    for a, b in zip(got.units, want.units):
        assert (a.name, a.param_bytes, a.output_bytes) == (b.name, b.param_bytes, b.output_bytes)
        assert a.flops == pytest.approx(b.flops, rel=0.1)  # attention kernels differ
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_profile_mode_is_meta_for_meta_models_and_models_over_the_budget():
    model = nn.Linear(100, 100)  # 40400 bytes of weights, as many of gradients
    assert profile_mode(model, None) == "measure"
    assert profile_mode(model, "1MiB") == "measure"
    assert profile_mode(model, 80_800) == "measure"
    assert profile_mode(model, 80_799) == "meta"  # weights fit, with gradients not
    model.requires_grad_(False)
    assert profile_mode(model, 40_400) == "measure"
    with torch.device("meta"):
        assert profile_mode(nn.Linear(2, 2), None) == "meta"


def test_7b_gpt_on_meta_device():
    # d_model 4096, 32 layers, vocab 32000, GELU MLP with ffn 16384 (4 x d_model),
    # untied head, no biases: 6.71e9 parameters, nothing allocated.
    cfg = GPTConfig(
        vocab_size=32000,
        d_model=4096,
        num_layers=32,
        num_heads=32,
        d_ffn=16384,
        max_seq_len=2048,
        tie_embeddings=False,
        bias=False,
    )
    start = time.perf_counter()
    with torch.device("meta"):
        model = TinyGPT(cfg)
    prof = profile_model(model, (torch.zeros(1, 2048, dtype=torch.long),), mode="meta")
    elapsed = time.perf_counter() - start
    assert prof.param_count == gpt_param_count(cfg) == 6_713_249_792
    assert len(prof.units) == 36
    block = prof.units[2]
    assert block.param_count == 12 * 4096 * 4096 + 2 * 4096
    assert block.flops > 6 * 2048 * block.param_count  # 6 * tokens * params, plus attention
    assert elapsed < 60


class _Cache:
    """Mutable state every block appends to (as a Hugging Face DynamicCache)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []


class _CachedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        out = self.lin(x) + sum(cache.seen, torch.zeros(()))
        cache.seen.append(out)
        return out


class _CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_CachedBlock() for _ in range(3))
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = _Cache()
        for block in self.blocks:
            x = block(x, cache)
        return self.norm(x) + torch.nn.functional.dropout(x, 0.5)


def test_profile_replays_units_on_private_inputs_and_leaves_no_trace():
    net, x = _CachedNet(), torch.randn(6, 4)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    prof = profile_model(net, (x,), repeats=2, warmup=1)
    assert [u.name for u in prof.units] == ["blocks.0", "blocks.1", "blocks.2", "norm"]
    # each block's replay saw the cache as it was when the block was called
    flops = [u.flops for u in prof.units[:3]]
    assert flops[0] == flops[1] == flops[2] > 0
    for key, value in net.state_dict().items():  # running statistics restored
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(torch.rand(3), expected_draw)  # the RNG too
