"""The split backward (I now, W later) gives the gradients of one ordinary backward.

Each case builds a small stage, runs it twice from the same inputs: once with
``torch.autograd.backward`` (the oracle), once as I (``split_backward``) and
then W. The input gradients must be there after I (and every gradient that is not a
linear layer's weight's: embeddings, norms, biases), the linear weights' only after W, and all of
them after W must equal the oracle's, also when ``.grad`` already holds a value
(accumulation over microbatches) or is a view into a flat buffer (ZeRO); then
whole models cut into stages (TinyGPT by default, Hugging Face families with
``-m slow``), backpropagated stage by stage in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpar.runtime._split_backward import defer_weight_gradients, split_backward


class PositionStage(nn.Module):
    """Like TinyGPT cut one unit per stage at ``wpe``: passes its input on and
    returns an output made from its weight alone."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.wpe(torch.arange(x.shape[1]))


class SharedBranchStage(nn.Module):
    """An output from the weight alone that also joins the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.emb(torch.arange(x.shape[1]))
        return self.lin(x + e), e * 2


class ViewStage(nn.Module):
    """Ends in views of an intermediate (which torch's helper would detach in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.lin(x).transpose(1, 2).split(3, dim=1))


class LossStage(nn.Module):
    """A last stage: returns a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).pow(2).mean()


def _oracle(stage: nn.Module, x: torch.Tensor, out_grads: list[torch.Tensor] | None):
    stage.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    outs = stage(leaf)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    torch.autograd.backward(outs, out_grads)
    return leaf.grad, {n: p.grad.clone() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("make", [PositionStage, SharedBranchStage, ViewStage, LossStage])
@pytest.mark.parametrize("grad_start", ["none", "accumulated", "flat_view"])
def test_input_then_weights_equal_one_backward(make, grad_start):
    torch.manual_seed(0)
    stage = make()
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        probe = stage(x)
    probe = list(probe) if isinstance(probe, tuple) else [probe]
    out_grads = None if make is LossStage else [torch.randn_like(o) for o in probe]
    want_input, want = _oracle(stage, x, out_grads)

    params = dict(stage.named_parameters())
    flat = torch.zeros(sum(p.numel() for p in params.values()))
    start = {n: torch.randn_like(p) for n, p in params.items()}
    offset = 0
    for n, p in params.items():
        if grad_start == "none":
            p.grad = None
        elif grad_start == "accumulated":
            p.grad = start[n].clone()
        else:  # .grad is a view into one flat buffer, as ZeRO binds it
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            p.grad.copy_(start[n])
        offset += p.numel()

    linear = {f"{name}.weight" for name, m in stage.named_modules() if isinstance(m, nn.Linear)}
    assert defer_weight_gradients(stage) == len(linear)
    leaf = x.detach().requires_grad_()
    outs = stage(leaf)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    weights = split_backward(outs, out_grads, (leaf,))
    torch.testing.assert_close(leaf.grad, want_input)  # I: the input gradient
    for n, p in params.items():  # ... no linear layer's gradient yet, the others done
        base = 0 if grad_start == "none" else start[n]
        if n not in linear:
            torch.testing.assert_close(p.grad, want[n] + base, msg=n)
        elif grad_start == "none":
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, start[n], msg=n)
    del outs
    weights()  # W
    for n, p in params.items():
        base = 0 if grad_start == "none" else start[n]
        torch.testing.assert_close(p.grad, want[n] + base, msg=n)
        if grad_start == "flat_view":
            assert p.grad._base is flat  # accumulated in place, still the bucket's view


def test_without_split_I_runs_the_whole_backward():
    torch.manual_seed(0)
    stage = PositionStage()
    x = torch.randn(2, 5, 4)
    grads = [torch.randn(2, 5, 4), torch.randn(5, 4)]
    _, want = _oracle(stage, x, grads)
    stage.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    weights = split_backward(list(stage(leaf)), grads, (leaf,), split=False)
    torch.testing.assert_close(stage.wpe.weight.grad, want["wpe.weight"])  # before W
    weights()
    torch.testing.assert_close(stage.wpe.weight.grad, want["wpe.weight"])
    lin = LossStage()
    defer_weight_gradients(lin)
    _, want = _oracle(lin, x, None)
    lin.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    split_backward([lin(leaf)], None, (leaf,), split=False)
    torch.testing.assert_close(lin.lin.weight.grad, want["lin.weight"])  # all in I


def test_linear_layers_defer_only_inside_I():
    """Outside I (a whole B, evaluation) a deferring layer computes its gradients at
    once; subclasses with their own forward are left alone."""

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4), nn.Linear(4, 2, bias=False))
    x = torch.randn(3, 4)
    dy = [torch.randn(3, 2)]
    _, want = _oracle(stage, x, dy)
    assert defer_weight_gradients(stage) == 2 and defer_weight_gradients(stage) == 2
    _, got = _oracle(stage, x, dy)  # a whole backward
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(stage(x), stage[2](stage[1](stage[0](x))))


class InPlaceStage(nn.Module):
    """A linear layer's output modified in place (``ReLU(inplace=True)``), a weight
    shared with an embedding, and a linear layer on a constant without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(6, 4)
        self.emb = nn.Embedding(6, 4)
        self.emb.weight = nn.Parameter(torch.randn(6, 4))
        self.tied = nn.Linear(4, 6, bias=False)
        self.tied.weight = self.emb.weight  # one parameter: a linear layer's and an embedding's
        self.const = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))
        h = h + self.tied(x) + self.emb(torch.arange(x.shape[1]) % 6)[..., :1]
        return self.out(h) + self.const(torch.ones(x.shape[-1]))


def test_in_place_outputs_tied_weights_and_constant_inputs():
    torch.manual_seed(0)
    stage = InPlaceStage()
    x = torch.randn(2, 5, 4)
    dy = [torch.randn(2, 5, 4)]
    want_input, want = _oracle(stage, x, dy)
    assert defer_weight_gradients(stage) == 4
    stage.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    weights = split_backward([stage(leaf)], dy, (leaf,))
    torch.testing.assert_close(leaf.grad, want_input)
    assert stage.lin.weight.grad is None and stage.out.weight.grad is None
    weights()
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)


def test_input_modified_in_place_after_the_layer_is_an_error():
    """As autograd itself refuses: W would read the modified input."""
    lin = nn.Linear(4, 4)
    defer_weight_gradients(lin)
    leaf = torch.randn(3, 4, requires_grad=True)
    h = leaf * 2
    out = lin(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="in-place"):
        split_backward([out.sum()], None, (leaf,))


# -- whole models cut into stages, in one process ----------------------------------


def _chain_grads(split, args, kwargs, loss_of, *, use_split):
    """Run the stages in a chain (each on fresh leaves, as the runtime does), then the
    backward from the last stage to the first: whole (oracle) or as I, with every W
    at the end. Returns each parameter's gradient, by name in the original model."""
    from mpar._tree import tree_leaves

    for stage in split.stages:
        stage.zero_grad(set_to_none=True)
    saved, out = [((), split.stages[0](*args, **kwargs))], None
    out = saved[0][1]
    for stage in split.stages[1:]:
        leaves = tuple(
            t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in out
        )
        out = stage(*leaves)
        saved.append((leaves, out))
    weights, grads = [], None
    for s in reversed(range(len(split.stages))):
        leaves, out = saved.pop()
        if s == len(split.stages) - 1:
            roots, root_grads = [loss_of(out)], None
        else:
            pairs = [
                (o, g)
                for o, g in zip(tree_leaves(out), grads)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
        if use_split:
            weights.append(split_backward(roots, root_grads, leaves))
        else:
            torch.autograd.backward(roots, root_grads)
        grads = [t.grad if isinstance(t, torch.Tensor) else None for t in leaves]
        del roots, root_grads, out
    for w in weights:
        w()
    result = {}
    for s, stage in enumerate(split.stages):
        for name, p in stage.named_parameters():
            result[split.qualnames[s][name]] = None if p.grad is None else p.grad.clone()
    return result


def _check_split_model(module, args, kwargs, loss_of, boundaries):
    from mpar.partition import find_units, split_module

    units = find_units(module, args, kwargs)
    split = split_module(module, args, kwargs, boundaries(len(units)), units=units)
    want = _chain_grads(split, args, kwargs, loss_of, use_split=False)
    assert sum(defer_weight_gradients(stage) for stage in split.stages[1:]) > 0
    got = _chain_grads(split, args, kwargs, loss_of, use_split=True)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        if grad is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _one_unit_per_stage(n):
    return list(range(n))


def _two_stages(n):
    return [0, n // 2]


@pytest.mark.parametrize(
    "boundaries", [_one_unit_per_stage, pytest.param(_two_stages, marks=pytest.mark.slow)]
)
def test_tiny_gpt_cut_into_stages(boundaries):
    """TinyGPT with its head tied to the token embedding (one Parameter in one
    process: the first and last stage both accumulate into it, as on zbv's rank 0)."""
    from tests.multiproc._pipeline_cases import batch, loss_fn, tiny_gpt

    x, y = batch("gpt", 0, size=4)
    _check_split_model(tiny_gpt(), (x,), {}, lambda out: loss_fn(out, y), boundaries)


HF = ["gpt2", "llama", "t5", "bert", "vit"]


@pytest.mark.slow
@pytest.mark.parametrize("family", HF)
def test_hugging_face_models_cut_one_unit_per_stage(family):
    pytest.importorskip("transformers")
    from tests.multiproc import _hf_cases

    inputs = {k: v[:2] for k, v in _hf_cases.batch(family, 0).items()}
    from mpar.runtime._adapt import disable_caches

    model = _hf_cases.build(family)
    disable_caches(model)  # as DistributedModel does
    _check_split_model(model, (), inputs, lambda out: out["loss"], _one_unit_per_stage)


@pytest.mark.parametrize("hooks", ["identity", "save_on_cpu"])
def test_split_under_saved_tensor_hooks(hooks):
    """A forward under saved-tensor hooks (mpar's own activation counting, a user's
    ``save_on_cpu``) still gets its weight gradients in W: the parameters must not be
    reached through what a hook unpacked."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(2, 5, 4)
    dy = [torch.randn(2, 5, 3)]
    _, want = _oracle(stage, x, dy)
    defer_weight_gradients(stage)
    stage.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    if hooks == "identity":
        context = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    else:
        context = torch.autograd.graph.save_on_cpu()
    with context:
        out = stage(leaf)
    weights = split_backward([out], dy, (leaf,))
    assert stage[0].weight.grad is None
    weights()
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)
