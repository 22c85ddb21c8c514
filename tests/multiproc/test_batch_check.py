"""The ranks of one pipeline must feed the same batch: a loader sharded by global
rank is an error naming the pipeline and the fix; ``mpar.data_sampler`` shards by
data-parallel rank and trains as one process does on the whole batch."""

from __future__ import annotations

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import batch, loss_fn, make_optimizer, mlp, start_training

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
STEPS, PER_STEP = 3, 8


def _dataset():
    x, y = batch("mlp", 0, size=STEPS * PER_STEP)
    return torch.utils.data.TensorDataset(x, y)


def _train(sampler_kind):
    """Train STEPS steps from a DataLoader with the given sampler; the losses."""
    import mpar

    model, opt, train = start_training(PP2, lambda params: make_optimizer("sgd", params))
    data = _dataset()
    if sampler_kind == "mpar":
        sampler = mpar.data_sampler(data, shuffle=False)
    else:  # the usual data-parallel recipe: one shard per global rank
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=PER_STEP, sampler=sampler)
    losses = []
    for x, y in loader:
        losses.append(train(model, x, y).reduce_mean())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses)


def test_a_loader_sharded_by_global_rank_is_an_error_naming_the_pipeline_and_the_fix():
    with pytest.raises(DistributedTestError, match=r"BatchMismatchError") as info:
        run_distributed(_train, 2, args=("global",), timeout=120)
    text = str(info.value)
    assert "ranks 0 and 1 (pipeline [0, 1])" in text
    assert "mpar.data_sampler(dataset)" in text and "mpar.dp_rank()" in text


def test_data_sampler_feeds_a_pipeline_the_same_batch_and_trains_as_one_process():
    net = mlp()
    opt = make_optimizer("sgd", net.parameters())
    data = _dataset()
    expected = []
    for x, y in torch.utils.data.DataLoader(data, batch_size=PER_STEP):
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.detach())
    for losses in run_distributed(_train, 2, args=("mpar",), timeout=120):
        torch.testing.assert_close(losses, torch.stack(expected), rtol=1e-5, atol=1e-6)
