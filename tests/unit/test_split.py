"""Stages run in a chain equal the original module: outputs and gradients (transparency)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from mpar.errors import PartitionError
from mpar.partition import find_units, split_module
from mpar.testing.models import GPTConfig, TinyGPT


def _check_transparent(model, args, kwargs, boundaries, pick=lambda o: o):
    reference = copy.deepcopy(model)
    split = split_module(model, args, kwargs, boundaries)
    out = split(*args, **kwargs)
    expected = reference(*args, **kwargs)
    assert type(out) is type(expected)
    torch.testing.assert_close(pick(out), pick(expected), rtol=1e-5, atol=1e-6)
    pick(out).float().square().sum().backward()
    pick(expected).float().square().sum().backward()
    params = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=1e-5, atol=1e-6)
    _check_ownership(model, split)
    return split


def _check_ownership(model, split):
    """Stages share the original tensors, and qualnames map onto the original names."""
    original = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for stage, names in zip(split.stages, split.qualnames):
        local = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
        for local_name, orig_name in names.items():
            assert local[local_name] is original[orig_name]
        assert set(names) == {n for n, _ in stage.named_parameters()} | set(names)
    covered = {n for names in split.qualnames for n in names.values()}
    assert {n for n, _ in model.named_parameters()} <= covered


def test_sequential():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    x = torch.randn(5, 8)
    split = _check_transparent(model, (x,), {}, [0, 2, 4])
    assert split.method == "sequential"
    assert split.units == [["0", "1"], ["2", "3"], ["4"]]
    assert isinstance(split.stages[0](x), tuple)
    assert split.qualnames[1] == {"2.weight": "2.weight", "2.bias": "2.bias"}
    assert split.tied == []


def test_sequential_any_batch_size():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    split = split_module(model, (torch.randn(3, 4),), None, [0, 1])
    assert split(torch.randn(7, 4)).shape == (7, 2)


def test_gpt_with_tied_embedding_and_head():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(num_layers=4, tie_embeddings=True))
    idx = torch.randint(0, 128, (2, 16))
    split = _check_transparent(model, (idx,), {}, [0, 3, 5])
    assert split.method == "graph"
    assert split.units[0] == ["wte", "wpe", "blocks.0"]
    assert split.units[-1] == ["blocks.3", "ln_f", "head"]
    (group,) = split.tied
    assert sorted(stage for stage, _ in group) == [0, 2]
    stage0, local0 = group[0]
    stage2, local2 = group[1]
    assert split.qualnames[stage0][local0] == split.qualnames[stage2][local2] == "wte.weight"
    # each stage returns a tuple except the last; stage k takes stage k-1's outputs
    out0 = split.stages[0](idx)
    assert isinstance(out0, tuple)
    assert isinstance(split.stages[1](*out0), tuple)


def test_state_dict_through_qualnames_loads_into_original():
    model = TinyGPT(GPTConfig(num_layers=2))
    idx = torch.randint(0, 128, (2, 8))
    split = split_module(model, (idx,), None, [0, 3])
    gathered = {}
    for stage, names in zip(split.stages, split.qualnames):
        for local, value in stage.state_dict().items():
            gathered[names[local]] = value
    fresh = TinyGPT(GPTConfig(num_layers=2))
    missing, unexpected = fresh.load_state_dict(gathered, strict=False)
    assert unexpected == []
    assert set(missing) <= {"head.weight"}  # the tied alias of wte.weight
    torch.testing.assert_close(fresh(idx), model(idx))


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:  # data-dependent control flow: cannot be one graph
            return self.b(y)
        return y


def test_uncapturable_model_is_a_partition_error():
    with pytest.raises(PartitionError, match="_DataDependent"):
        split_module(_DataDependent(), (torch.randn(2, 4),), None, [0, 1], units=["a", "b"])


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_out_of_order_units_are_rejected():
    with pytest.raises(PartitionError, match="contiguously"):
        split_module(_Skip(), (torch.randn(2, 4),), None, [0, 1], units=["b", "a", "c"])


class _Reused(nn.Module):
    """A block applied twice, with two other blocks between the calls (weights shared)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.c(torch.tanh(self.shared(h)))


def test_a_module_called_again_on_a_later_stage_shares_its_weights():
    """The second call of ``shared`` needs ``b``'s output, on stage 1: it runs there,
    and the stages hold ``shared``'s parameters as tied ones (before: "uses a value
    computed by module 'b' on stage 1, so the stages would not run in order")."""
    torch.manual_seed(0)
    split = _check_transparent(_Reused(), (torch.randn(3, 4),), {}, [0, 2])
    assert split.units == [["shared", "a"], ["b", "c"]]
    tied = sorted(split.qualnames[k][name] for group in split.tied for k, name in group)
    assert tied == ["shared.bias", "shared.bias", "shared.weight", "shared.weight"]


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class _ReturnsDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return _Output(logits=self.b(h), hidden=h)


def test_a_model_returning_a_dataclass_splits():
    """Before: PartitionError ("Found <class '..._Output'> in output, which is not a
    known type ... Remove data-dependent control flow"); the dataclass is now registered
    with torch.export and the last stage returns it."""
    torch.manual_seed(0)
    split = _check_transparent(
        _ReturnsDataclass(), (torch.randn(3, 4),), {}, [0, 1], pick=lambda o: o.logits
    )
    assert isinstance(split(torch.randn(2, 4)), _Output)


def test_module_hooks_in_a_captured_model():
    """Before: a backward hook was dropped by the capture without a word (never called,
    and one that changes gradients trained another model); forward hooks ran only while
    the model was captured. Now backward hooks are refused and forward hooks warned of."""
    model = _Skip()
    model.b.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(PartitionError, match=r"\['b'\] have backward hooks"):
        split_module(model, (torch.randn(2, 4),), None, [0, 1])
    model = _Skip()
    model.b.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.warns(UserWarning, match=r"\['b'\] have forward hooks"):
        _check_transparent(model, (torch.randn(2, 4),), {}, [0, 1])


def test_hugging_face_output_capturing_hooks_are_not_warned_of(recwarn):
    """Before: every Mixtral run (the finetune_mixtral example included) warned that
    model.layers.0, its self_attn and mlp.gate "have forward hooks": transformers 5's
    hooks that hand router logits to the model's own output, which the capture records."""
    capture = pytest.importorskip("transformers.utils.output_capturing")
    model = _Skip()
    capture.install_output_capuring_hook(model.b, "router_logits", 0)
    _check_transparent(model, (torch.randn(2, 4),), {}, [0, 1])
    assert not [w for w in recwarn if "forward hooks" in str(w.message)]
    model = _Skip()
    capture.install_output_capuring_hook(model.b, "router_logits", 0)
    model.a.register_forward_hook(lambda m, i, o: None)  # a user's hook still is
    with pytest.warns(UserWarning, match=r"\['a'\] have forward hooks"):
        _check_transparent(model, (torch.randn(2, 4),), {}, [0, 1])


def test_bad_boundaries():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(PartitionError, match="boundaries"):
        split_module(model, (torch.randn(1, 2),), None, [1])
    with pytest.raises(PartitionError, match="boundaries"):
        split_module(model, (torch.randn(1, 2),), None, [0, 2])


# Hugging Face GPT-2 and BERT: tests/unit/test_split_dynamic.py


def test_torchvision_resnet18():
    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    units = find_units(model, (x,))
    split = split_module(model, (x,), None, [0, len(units) // 2], units=units)
    torch.testing.assert_close(split(x), model(x))
