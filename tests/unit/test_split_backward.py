"""The split backward (I now, W later) gives the gradients of one ordinary backward.

Each case builds a small stage, runs it twice from the same inputs: once with
``torch.autograd.backward`` (the oracle), once as I (``split_backward``) and
then W. The input gradients must be there after I, and the weight gradients
after W must equal the oracle's, also when ``.grad`` already holds a value
(accumulation over microbatches) or is a view into a flat buffer (ZeRO).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpar.config import config_from_dict
from mpar.runtime._split_backward import SPLIT_ENV, split_backward


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


CONFIG = config_from_dict({})


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

    leaf = x.detach().requires_grad_()
    outs = stage(leaf)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    weights = split_backward(outs, out_grads, (leaf,), stage, CONFIG)
    torch.testing.assert_close(leaf.grad, want_input)  # I: the input gradient
    for n, p in params.items():  # ... and no weight gradient yet
        if grad_start == "none":
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


def test_without_split_I_runs_the_whole_backward(monkeypatch):
    monkeypatch.setenv(SPLIT_ENV, "0")
    torch.manual_seed(0)
    stage = PositionStage()
    x = torch.randn(2, 5, 4)
    grads = [torch.randn(2, 5, 4), torch.randn(5, 4)]
    _, want = _oracle(stage, x, grads)
    stage.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    weights = split_backward(list(stage(leaf)), grads, (leaf,), stage, CONFIG)
    torch.testing.assert_close(stage.wpe.weight.grad, want["wpe.weight"])  # before W
    weights()
    torch.testing.assert_close(stage.wpe.weight.grad, want["wpe.weight"])
