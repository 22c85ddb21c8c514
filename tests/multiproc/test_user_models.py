"""Hand-written models and training loops as a new user writes them, against one process.

Each case is a regression found by training ordinary ``nn.Module``s (not Hugging Face)
with mpar: a model wrapped around one ``nn.Sequential``, a learning-rate scheduler
stepping the ``DistributedOptimizer``, ... Every check compares with the same model
trained in one process on the whole batch (fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import BATCH, batch, loss_fn, mlp, train_loss

TOL = {"rtol": 1e-5, "atol": 1e-6}


class Wrapped(nn.Module):
    """Layers in one ``nn.Sequential`` beside a module the forward never calls: the
    root's rules give one unit, which is expanded so that two stages can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _scheduled(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _reference(steps: int) -> dict[str, Any]:
    net = Wrapped()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = _scheduled(opt)
    losses = []
    for s in range(steps):
        x, y = batch("mlp", s)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "state": state, "lr": opt.param_groups[0]["lr"]}


def _train(config: dict[str, Any], steps: int) -> dict[str, Any]:
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(Wrapped())
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scheduler = _scheduled(opt)
    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    losses = []
    for s in range(steps):
        x, y = batch("mlp", s)
        shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        losses.append(float(train_loss(model, x[shard], y[shard]).reduce_mean()))
        opt.step()
        opt.zero_grad()
        scheduler.step()
    saved = opt.state_dict()
    return {
        "losses": losses,
        "state": model.state_dict(),
        "lr": saved["param_groups"][0]["lr"],
        "units": [list(stage.units) for stage in model.plan.stages],
    }


def _check(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
        assert got["lr"] == ref["lr"]
        assert [u for units in got["units"] for u in units] == [f"net.{i}" for i in range(8)]
        assert all(got["units"])  # two stages, each with some of net's layers


def test_a_scheduler_steps_the_distributed_optimizer_at_every_layout():
    """``StepLR(DistributedOptimizer)`` was refused ("not an Optimizer"), and a learning
    rate set on the wrapped optimizer's groups never reached the optimizer that steps
    the shards (data parallelism, any ZeRO stage): the second step still ran at the
    first rate. Also: a model that wraps one ``nn.Sequential`` beside an unused module
    splits into two stages (before: "1 partitionable units")."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 1}}
    results = run_distributed(_train, 4, args=(config, 3), timeout=120)
    _check(results, _reference(3))
