"""Manual placement: ``auto_partition: false`` with ``mpar.partition(i)`` blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import batch, loss_fn


def _build() -> nn.Module:
    import mpar

    torch.manual_seed(0)
    model = nn.Sequential()
    with mpar.partition(0):
        model.append(nn.Linear(8, 16))
        model.append(nn.Tanh())
    with mpar.partition(1):
        model.append(nn.Linear(16, 16))
        model.append(nn.ReLU())
        model.append(nn.Linear(16, 4))
    return model


def _manual_ranks():
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False})
    model = mpar.DistributedModel(_build())
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    for s in range(2):
        train(model, *batch("mlp", s))
        opt.step()
        opt.zero_grad()
    return str(model.plan), [n for n, _ in model.named_parameters()], model.state_dict()


def test_manual_placement_is_used_and_transparent():
    results = run_distributed(_manual_ranks, 2, timeout=120)
    plan, names0, state = results[0]
    assert "manual partition" in plan
    assert names0 == ["0.weight", "0.bias"]
    assert results[1][1] == ["2.weight", "2.bias", "4.weight", "4.bias"]
    ref = _build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(2):
        x, y = batch("mlp", s)
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def _unplaced_ranks():
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False})
    torch.manual_seed(0)
    model = mpar.DistributedModel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    train(model, *batch("mlp", 0))


@pytest.mark.timeout(60)
def test_manual_placement_that_leaves_a_stage_empty_is_refused_by_name():
    # nothing placed with mpar.partition: every unit would be on stage 0 of 2
    with pytest.raises(DistributedTestError, match=r"PartitionError.*on 1 stage\(s\), 0 to 0"):
        run_distributed(_unplaced_ranks, 2, timeout=50)
