"""mpar.materialize: a meta-built model initialised by its own initialisers, per name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpar
from mpar.meta import InitError, build_module
from mpar.meta._init import init_groups, initialize_group, module_initializer


def _torch_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def _meta(factory) -> nn.Module:
    with torch.device("meta"):
        return factory()


def test_torch_modules_use_reset_parameters_and_are_deterministic():
    a = mpar.materialize(_meta(_torch_model), seed=1).state_dict()
    b = mpar.materialize(_meta(_torch_model), seed=1).state_dict()
    c = mpar.materialize(_meta(_torch_model), seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["1.weight"], c["1.weight"])
    assert torch.equal(a["2.running_var"], torch.ones(6))  # buffers recomputed
    assert int(a["2.num_batches_tracked"]) == 0
    assert not any(t.isnan().any() for t in a.values() if t.is_floating_point())
    bound = 1 / 4**0.5  # nn.Linear's reset_parameters: U(-1/sqrt(in), 1/sqrt(in))
    assert a["1.weight"].abs().max() <= bound


def test_values_do_not_depend_on_the_order_groups_are_initialised():
    want = mpar.materialize(_meta(_torch_model), seed=3).state_dict()
    model = _meta(_torch_model)
    shapes = {id(t): t.shape for t in [*model.parameters(), *model.buffers()]}
    run = module_initializer(model, None)
    for group in reversed(init_groups(model)):
        initialize_group(group, seed=3, run=run, shapes=shapes)
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("table", torch.arange(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.table


def test_a_tensor_no_initialiser_sets_is_an_error_naming_it():
    with pytest.raises(InitError, match=r"scale \(\(3,\)"):
        mpar.materialize(_meta(_Custom))


def test_init_fn_initialises_modules_buffers_included():
    def init_fn(m: nn.Module) -> None:
        if isinstance(m, _Custom):
            m.scale.data.fill_(2.0)
            m.table.copy_(torch.arange(3.0))

    model = mpar.materialize(_meta(_Custom), init_fn=init_fn)
    assert torch.equal(model.scale.detach(), torch.full((3,), 2.0))
    assert torch.equal(model.table, torch.arange(3.0))


def test_real_tensors_are_kept():
    model = _meta(_torch_model)
    model[1].weight = nn.Parameter(torch.full((6, 4), 5.0))
    mpar.materialize(model)
    assert torch.equal(model[1].weight.detach(), torch.full((6, 4), 5.0))
    assert not model[1].bias.isnan().any()


def test_parameters_stay_the_same_objects():
    model = _meta(_torch_model)
    weight = model[1].weight
    mpar.materialize(model)
    assert model[1].weight is weight and not weight.is_meta


def test_hugging_face_buffers_and_tied_weights():
    hf = pytest.importorskip("transformers")
    cfg = hf.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32, tie_word_embeddings=True,
    )  # fmt: skip
    real = hf.LlamaForCausalLM(cfg)
    model = mpar.materialize(_meta(lambda: hf.LlamaForCausalLM(cfg)), seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    std = float(model.model.layers[0].mlp.up_proj.weight.std())
    assert 0.015 < std < 0.025  # initializer_range 0.02: _init_weights ran
    bert_cfg = hf.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=20,
    )  # fmt: skip
    bert = mpar.materialize(_meta(lambda: hf.BertModel(bert_cfg)))
    assert torch.equal(bert.embeddings.position_ids, torch.arange(20).expand(1, -1))


def test_build_module_checks_the_factory():
    with pytest.raises(TypeError, match="zero-argument factory"):
        build_module(3)
    with pytest.raises(TypeError, match="returned int"):
        build_module(lambda: 3)
    built = build_module(lambda: nn.Linear(2, 2))
    assert built.weight.is_meta
    with pytest.raises(ValueError, match="seed"):
        mpar.materialize(_meta(_torch_model), seed=-1)


def test_groups_a_pending_load_overwrites_are_not_initialised():
    from mpar.meta import RankMaterializer

    model = _meta(_torch_model)
    called: list[str] = []

    def init(m: nn.Module) -> None:
        called.append(type(m).__name__)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            t.fill_(1)

    # every tensor of the first Linear and of the BatchNorm will be loaded; the
    # second Linear's bias will not, so its group is initialised as usual
    names = ["1.weight", "1.bias", "3.weight"]
    names += [n for n, _ in model[2].named_buffers(prefix="2")] + ["2.weight", "2.bias"]
    mat = RankMaterializer(
        model, [model], seed=0, device=torch.device("cpu"), init_fn=init, overwritten=names
    )
    mat.ensure_or_defer(model[1].weight)  # what a bucket calls: stays meta for the load
    assert model[1].weight.is_meta
    mat.ensure(model[2].running_mean)  # outside buckets: storage, uninitialised
    assert not model[2].running_mean.is_meta
    mat.ensure_or_defer(model[3].weight)  # a group the load does not cover whole
    assert not model[3].weight.is_meta and not model[3].bias.is_meta
    assert torch.equal(model[3].bias.detach(), torch.ones(2))
    assert called == ["Linear"]  # only the second Linear's initialiser ran


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8, dtype=torch.bool)))
        self.register_buffer("steps", torch.zeros((), dtype=torch.uint8))


def test_bool_and_unsigned_buffers_are_initialised_or_named():
    with pytest.raises(InitError, match=r"^mask \(\(8, 8\), torch.bool\), a buffer.*init_fn="):
        mpar.materialize(_meta(_Masked))
    eager = _Masked()

    def init_fn(m: nn.Module) -> None:  # covers the mask only: Linear keeps reset_parameters
        if isinstance(m, _Masked):
            m.mask.copy_(torch.tril(torch.ones(8, 8, dtype=torch.bool)))
            m.steps.zero_()  # an unsigned buffer set to 0 counts as set

    model = mpar.materialize(_meta(_Masked), init_fn=init_fn)
    assert torch.equal(model.mask, eager.mask) and int(model.steps) == 0
    assert not model.proj.weight.isnan().any() and model.proj.weight.abs().max() <= 0.5
