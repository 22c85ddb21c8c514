"""Traced stages accept other batch sizes and follow train/eval mode (transparency)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpar.partition import find_units, split_module
from mpar.testing.models import GPTConfig, TinyGPT

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _chain(split, args, kwargs):
    """Run the stages one by one, checking the contract between them."""
    out = split.stages[0](*args, **kwargs)
    for stage in split.stages[1:]:
        assert isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
        out = stage(*out)
    return out


def _compare(model, reference, split, args, kwargs, pick=lambda o: o, seed=None):
    """Outputs and gradients of the split chain equal the reference's on these inputs."""
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    out = pick(_chain(split, args, kwargs))
    if seed is not None:
        torch.manual_seed(seed)
    expected = pick(reference(*args, **kwargs))
    torch.testing.assert_close(out, expected, **TOL)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, ref in reference.named_parameters():
        torch.testing.assert_close(grads[name], ref.grad, **TOL)
    return out


@pytest.fixture(scope="module")
def tiny():
    """TinyGPT, an untouched copy, and its split made from a batch of 4."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(num_layers=3))
    reference = copy.deepcopy(model)
    return model, reference, split_module(model, (torch.randint(0, 128, (4, 8)),), None, [0, 3, 5])


def test_tiny_gpt_any_batch_size(tiny):
    for batch in (3, 2, 1, 5):
        idx = torch.randint(0, 128, (batch, 8))
        assert _compare(*tiny, (idx,), {}).shape == (batch, 8, 128)


def test_example_of_one_sample_still_gives_dynamic_batch():
    model = TinyGPT(GPTConfig(num_layers=2))
    reference = copy.deepcopy(model)
    split = split_module(model, (torch.randint(0, 128, (1, 8)),), None, [0, 3])
    for batch in (3, 1):
        _compare(model, reference, split, (torch.randint(0, 128, (batch, 8)),), {})


def test_sequence_axis_fixed_by_default_dynamic_on_request(tiny):
    model, reference, split = tiny
    with pytest.raises(ValueError, match="'idx' axis 1 has size 5"):
        split(torch.randint(0, 128, (2, 5)))
    split = split_module(model, (torch.randint(0, 128, (4, 8)),), None, [0, 3], dynamic_axes=(0, 1))
    for batch, seq in ((3, 5), (1, 1), (2, 16)):
        _compare(model, reference, split, (torch.randint(0, 128, (batch, seq)),), {})


def test_stage_interface_errors(tiny):
    split = tiny[2]
    out = split.stages[0](torch.randint(0, 128, (2, 8)))
    with pytest.raises(TypeError, match="stage 1 takes"):
        split.stages[1](*out, out[0])
    with pytest.raises(ValueError, match="expected a tensor with 2 axes"):
        split.stages[0](torch.randint(0, 128, (2, 8, 1)))


class _Flat(nn.Module):
    """A later stage needs the batch and sequence sizes that only the input has."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, idx):
        b, t = idx.shape
        h = self.lin(self.emb(idx).reshape(b * t, 4))
        return self.out(h.reshape(b, t, 4))


def test_sizes_are_recomputed_not_carried():
    model = _Flat()
    reference = copy.deepcopy(model)
    split = split_module(model, (torch.randint(0, 10, (4, 3)),), None, [0, 1, 2])
    for batch in (2, 1, 7):
        _compare(model, reference, split, (torch.randint(0, 10, (batch, 3)),), {})


@pytest.mark.parametrize("split_mode", ["train", "eval"])
def test_dropout_follows_stage_and_original_mode(split_mode):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(num_layers=3, dropout=0.5)).train(split_mode == "train")
    reference = copy.deepcopy(model)
    split = split_module(model, (torch.randint(0, 128, (4, 8)),), None, [0, 3, 5])
    assert all(stage.training == model.training for stage in split.stages)
    idx = torch.randint(0, 128, (3, 8))
    for stage in split.stages:  # the stages' own mode
        stage.eval()
    reference.eval()
    evaluated = _compare(model, reference, split, (idx,), {})
    for stage in split.stages:
        stage.train()
    reference.train()
    trained = _compare(model, reference, split, (idx,), {}, seed=7)
    assert not torch.allclose(trained, evaluated)  # dropout is active
    flip = not model.training
    for mode in (flip, not flip, flip):  # changes of the original module's mode
        model.train(mode)
        reference.train(mode)
        _compare(model, reference, split, (idx,), {}, seed=3)
        assert all(stage.training == mode for stage in split.stages)


class _Positions(nn.Module):
    """Creates tensors on its input's device, which export records as the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        return self.b(self.a(x) + pos), torch.zeros(x.shape[0], device=x.device)


def test_created_tensors_follow_the_input_device():
    model = _Positions()
    split = split_module(model, (torch.randn(2, 4),), None, [0, 1], units=["a", "b"])
    assert "device(type='cpu')" not in split.stages[1].code
    for stage in split.stages:  # as a runtime moves its stages to its device
        stage.to("meta")
    out, zeros = split(torch.randn(3, 4, device="meta"))
    assert out.device.type == zeros.device.type == "meta" and zeros.shape == (3,)


class _EvalOnlyBranch(nn.Module):
    """Export can capture train mode but not eval mode (data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        if not self.training and y.sum() > 0:
            y = -y
        return self.b(y)


def test_mode_that_cannot_be_captured_fails_when_used():
    model = _EvalOnlyBranch().train()
    split = split_module(model, (torch.randn(3, 4),), None, [0, 1], units=["a", "b"])
    torch.testing.assert_close(split(torch.randn(2, 4)).shape, torch.Size([2, 4]))
    model.eval()
    with pytest.raises(RuntimeError, match="cannot run in eval mode: cannot split _EvalOnly"):
        split(torch.randn(2, 4))


def _transformers():
    return pytest.importorskip("transformers")


def _gpt2(tf, dropout):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=3,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=16,
        use_cache=False,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(cfg)


def _bert_inputs(batch, seq=8):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2 :] = 0
    return {"input_ids": torch.randint(0, 64, (batch, seq)), "attention_mask": mask}


def test_hf_gpt2_batch_sizes_and_dropout():
    tf = _transformers()
    model = _gpt2(tf, dropout=0.5).train()
    reference = copy.deepcopy(model)
    example = torch.randint(0, 64, (4, 8))
    units = find_units(model, (example,))
    assert units[:2] == ["transformer.wte", "transformer.wpe"]
    assert units[-5:] == [
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f",
        "lm_head",
    ]
    split = split_module(model, (example,), None, [0, 4, 6], units=units)
    assert len(split.tied) == 1  # wte and lm_head
    logits = lambda o: o.logits  # noqa: E731
    for batch in (3, 2, 1):
        idx = torch.randint(0, 64, (batch, 8))
        _compare(model, reference, split, (idx,), {}, pick=logits, seed=batch)
    model.eval()
    reference.eval()
    for batch in (3, 1):
        _compare(model, reference, split, (torch.randint(0, 64, (batch, 8)),), {}, pick=logits)


def test_hf_bert_batch_sizes_and_sequence_bound():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.5,
        attention_probs_dropout_prob=0.0,
    )
    model = tf.BertForMaskedLM(cfg).eval()
    reference = copy.deepcopy(model).eval()
    assert find_units(model, (), _bert_inputs(4)) == [
        "bert.embeddings",
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
        "bert.encoder.layer.2",
        "cls",
    ]
    split = split_module(model, (), _bert_inputs(4), [0, 2, 3], dynamic_axes=(0, 1))
    keys = set(model.state_dict())  # position_ids is not persistent: not in either
    for stage, names in zip(split.stages, split.qualnames):
        assert {names[local] for local in stage.state_dict()} <= keys
    logits = lambda o: o.logits  # noqa: E731
    for batch, seq in ((3, 8), (2, 5), (1, 16)):
        _compare(model, reference, split, (), _bert_inputs(batch, seq), pick=logits)
    with pytest.raises(ValueError, match="only accepts"):
        split(**_bert_inputs(2, 17))
    model.train()
    reference.train()
    _compare(model, reference, split, (), _bert_inputs(3, 6), pick=logits, seed=1)
