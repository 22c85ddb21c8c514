"""Manual placement: ``auto_partition: false`` with ``mpar.partition(i)`` blocks."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import batch, loss_fn


def _build(by_default: bool = False) -> nn.Module:
    """Two stages placed by ``mpar.partition``; ``by_default``: stage 1's modules are
    created outside any, for ``default_partition: 1`` to place (as smp users do)."""
    import mpar

    torch.manual_seed(0)
    model = nn.Sequential()
    with mpar.partition(0):
        model.append(nn.Linear(8, 16))
        model.append(nn.Tanh())
    with contextlib.nullcontext() if by_default else mpar.partition(1):
        model.append(nn.Linear(16, 16))
        model.append(nn.ReLU())
        model.append(nn.Linear(16, 4))
    return model


def _manual_ranks(by_default: bool = False):
    import mpar

    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False}
    mpar.init({**config, "default_partition": 1} if by_default else config)
    model = mpar.DistributedModel(_build(by_default))
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


@pytest.mark.parametrize("by_default", [False, True])
def test_manual_placement_is_used_and_transparent(by_default):
    """``by_default``: default_partition 1 places what no ``partition(i)`` did (it only
    named the first unit's stage, so these joined stage 0, one stage for two ranks)."""
    results = run_distributed(_manual_ranks, 2, args=(by_default,), timeout=120)
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


def _two_widths(width: int) -> nn.Module:
    import mpar

    torch.manual_seed(width)
    model = nn.Sequential()
    with mpar.partition(0):
        model.append(nn.Linear(8, width))
    with mpar.partition(1):
        model.append(nn.Linear(width, 4))
    return model


def _train(m, x, y):
    loss = loss_fn(m(x), y)
    m.backward(loss)
    return loss


def _two_models_ranks(nccl_rules: bool):
    """Two models trained one after the other by one step function on alike batches:
    what their stages send differs (16 then 6 features), so the second model's
    transfers are agreed afresh (the agreed shapes are the model's, not the code's)."""
    import mpar

    mpar.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "auto_partition": False,
            "nccl_rules": nccl_rules,
        }
    )
    train = mpar.step(_train)
    losses = []
    for width in (16, 6, 16):
        model = mpar.DistributedModel(_two_widths(width))
        losses.append([float(train(model, *batch("mlp", s)).reduce_mean()) for s in range(2)])
        del model
    return losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nccl_rules", [False, True], ids=["default", "nccl_rules"])
def test_models_sharing_a_step_function_agree_their_own_transfers(nccl_rules):
    results = run_distributed(_two_models_ranks, 2, args=(nccl_rules,), timeout=100)
    for got, width in zip(results[1], (16, 6, 16)):
        ref = _two_widths(width)
        with torch.no_grad():
            expected = [
                float(loss_fn(ref(x), y)) for x, y in map(lambda s: batch("mlp", s), range(2))
            ]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
