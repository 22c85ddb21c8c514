"""Stage inputs: a batch that is a view (``tokens[:, :-1]``) and then a fresh batch
of the same shape run the same captured stages, as one process would."""

from __future__ import annotations

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import loss_fn, make_optimizer, tiny_gpt


def _tokens():
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))


def _batches():
    tokens = _tokens()
    sliced = (tokens[:, :-1], tokens[:, 1:])  # views: their base is (4, 9)
    return [sliced, tuple(t.contiguous() for t in sliced), sliced]


def _train_views():
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = mpar.DistributedModel(tiny_gpt())
    opt = mpar.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    losses = []
    for x, y in _batches():
        losses.append(train(model, x, y).reduce_mean())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses)


def test_a_view_batch_then_a_contiguous_batch_of_the_same_shape():
    net = tiny_gpt()
    opt = make_optimizer("sgd", net.parameters())
    expected = []
    for x, y in _batches():
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.detach())
    for losses in run_distributed(_train_views, 2, timeout=120):
        torch.testing.assert_close(losses, torch.stack(expected), rtol=1e-5, atol=1e-6)


def _train_lengths(dynamic_axes):
    """Sequences of 8 tokens, then of 6."""
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    kw = {} if dynamic_axes is None else {"dynamic_axes": dynamic_axes}
    model = mpar.DistributedModel(tiny_gpt(), **kw)

    @mpar.step
    def forward(m, x, y):
        return loss_fn(m(x), y)

    tokens = _tokens()
    with torch.no_grad():
        return [forward(model, tokens[:, :n], tokens[:, 1 : n + 1]).reduce_mean() for n in (8, 6)]


@pytest.mark.slow
def test_another_sequence_length_needs_dynamic_axes_and_the_error_says_so():
    with pytest.raises(DistributedTestError, match=r"dynamic_axes=\(0, 1\)\)"):
        run_distributed(_train_lengths, 2, args=(None,), timeout=120)
    net, tokens = tiny_gpt(), _tokens()
    with torch.no_grad():
        expected = [loss_fn(net(tokens[:, :n]), tokens[:, 1 : n + 1]) for n in (8, 6)]
    for losses in run_distributed(_train_lengths, 2, args=((0, 1),), timeout=120):
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
