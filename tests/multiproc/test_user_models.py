"""Hand-written models and training loops as a new user writes them, against one process.

Each case is a regression found by training ordinary ``nn.Module``s (not Hugging Face)
with mpar: a model wrapped around one ``nn.Sequential``, a learning-rate scheduler
stepping the ``DistributedOptimizer``, ... Every check compares with the same model
trained in one process on the whole batch (fp32).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
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


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _scheduled(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _one_process(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> dict[str, Any]:
    """``net`` trained in one process on the whole batch: its losses and final state."""
    losses = []
    for s in range(steps):
        x, y = batch("mlp", s)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()}}


def _replica_losses(
    model: Any,
    opt: Any,
    steps: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> list[float]:
    """Rank body's loop: ``model`` trained on this replica's shard of each batch."""
    import mpar

    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    losses = []
    for s in range(steps):
        x, y = batch("mlp", s)
        shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        losses.append(float(train_loss(model, x[shard], y[shard]).reduce_mean()))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def _check_trained(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """One rank's losses and final parameters are the one-process run's."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
    for name, tensor in ref["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)


def _reference(steps: int) -> dict[str, Any]:
    net = Wrapped()
    opt = _sgd(net.parameters())
    return {**_one_process(net, opt, steps, _scheduled(opt)), "lr": opt.param_groups[0]["lr"]}


def _train(config: dict[str, Any], steps: int) -> dict[str, Any]:
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(Wrapped())
    opt = mpar.DistributedOptimizer(_sgd(model.parameters()))
    losses = _replica_losses(model, opt, steps, _scheduled(opt))
    saved = opt.state_dict()
    return {
        "losses": losses,
        "state": model.state_dict(),
        "lr": saved["param_groups"][0]["lr"],
        "units": [list(stage.units) for stage in model.plan.stages],
    }


def _check(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for got in results:
        _check_trained(got, ref)
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
    results = run_distributed(_train, 4, args=(config, 2), timeout=120)
    _check(results, _reference(2))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.l2 = nn.Linear(16, 16)
        self.bn2 = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.l1(x)))
        return self.head(torch.relu(self.bn2(self.l2(h))))


def _batch_norm_reference(steps: int, dp: int, m: int) -> dict[str, Any]:
    """mpar's documented batch norm, in one process: each microbatch is normalised by its
    own statistics and updates the running ones; every replica starts the step from the
    same statistics and they are averaged over the replicas at its end (the counter
    advances by the microbatches of one replica)."""
    net = BatchNormNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for s in range(steps):
        x, y = batch("mlp", s)
        start = {k: v.clone() for k, v in net.named_buffers()}
        ends, total = [], 0.0
        for r in range(dp):
            net.load_state_dict(start, strict=False)
            shard = slice(r * BATCH // dp, (r + 1) * BATCH // dp)
            for xc, yc in zip(x[shard].tensor_split(m), y[shard].tensor_split(m)):
                loss = loss_fn(net(xc), yc)
                share = len(xc) / (BATCH // dp) / dp
                (loss * share).backward()
                total += loss.item() * share
            ends.append({k: v.clone() for k, v in net.named_buffers()})
        averaged = {
            k: torch.stack([e[k] for e in ends]).mean(0) if v.is_floating_point() else v
            for k, v in ends[0].items()
        }
        net.load_state_dict(averaged, strict=False)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()}}


def _train_batch_norm(config: dict[str, Any], steps: int) -> dict[str, Any]:
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(BatchNormNet())
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return {"losses": _replica_losses(model, opt, steps), "state": model.state_dict()}


@pytest.mark.parametrize(
    "pp",
    [1, pytest.param(2, marks=pytest.mark.slow)],  # pp 2: stages captured as graphs
)
def test_batch_norm_statistics_are_averaged_over_replicas(pp):
    """Each data-parallel replica updated its own running statistics: the replicas'
    models drifted apart and ``state_dict()`` differed from rank to rank. Now they are
    averaged after every step (as documented), on every rank alike."""
    config = {"pipeline_parallel_degree": pp, "microbatches": 2}
    results = run_distributed(_train_batch_norm, 2 * pp, args=(config, 3), timeout=120)
    ref = _batch_norm_reference(3, dp=2, m=2)
    for got in results:
        _check_trained(got, ref)


class Reused(nn.Module):
    """A block applied twice with two blocks between the calls: the two calls land on
    different pipeline ranks, which both hold the block's weights (tied)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.head(torch.tanh(self.shared(h)))


def _reused_reference(steps: int) -> dict[str, Any]:
    net = Reused()
    return _one_process(net, _sgd(net.parameters()), steps)


def _train_reused(config: dict[str, Any], steps: int) -> dict[str, Any]:
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(Reused())
    opt = mpar.DistributedOptimizer(_sgd(model.parameters()))
    losses = _replica_losses(model, opt, steps)
    held = [name for name, _ in model.named_parameters()]
    return {"losses": losses, "state": model.state_dict(), "held": held}


def test_a_block_called_twice_trains_across_pipeline_ranks():
    """Before: PartitionError ("module 'shared' on stage 0 uses a value computed by
    module 'b' on stage 1"); now the second call runs on rank 1 with the weights tied."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "memory_weight": 0.0}
    results = run_distributed(_train_reused, 2, args=(config, 2), timeout=120)
    ref = _reused_reference(2)
    for got in results:
        assert "shared.weight" in got["held"]  # on both ranks: each runs one call
        _check_trained(got, ref)


class Feedforward(nn.Module):
    """Blocks of up (colwise) and down (rowwise) projections, split by a user's plan."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.up = nn.ModuleList(nn.Linear(16, 32) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(32, 16) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for up, down in zip(self.up, self.down):
            h = h + down(torch.relu(up(h)))
        return self.head(h)


FEEDFORWARD_PLAN = {"up.*": "colwise", "down.*": "rowwise"}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.01)


def _feedforward_reference(steps: int) -> dict[str, Any]:
    net = Feedforward()
    opt = _adamw(net.parameters())
    saved = None
    for s in range(steps):
        x, y = batch("mlp", s)
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        if s == 0:
            saved = copy.deepcopy(opt.state_dict())  # torch's holds the live tensors
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {"saved": saved, "state": state}


def _train_feedforward(config: dict[str, Any], reload: dict[str, Any]) -> dict[str, Any]:
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(Feedforward())
    opt = mpar.DistributedOptimizer(_adamw(model.parameters()))
    saved = None
    for s in range(2):
        x, y = batch("mlp", s)
        train_loss(model, x, y)
        opt.step()
        opt.zero_grad()
        if s == 0:
            saved = opt.state_dict()
            opt.load_state_dict(reload)  # the one-process optimizer's own state
    return {"saved": saved, "state": model.state_dict()}


def test_optimizer_state_dict_is_the_unwrapped_optimizers_under_tensor_parallelism():
    """Before: ``DistributedOptimizer.state_dict()`` held each TP rank's pieces of the
    moments (shape [16, 16] for a [32, 16] weight), not the unwrapped optimizer's
    format it promises; now the pieces are assembled, and a whole state loads (cut)."""
    config = {"tensor_parallel_degree": 2, "tp_plan": FEEDFORWARD_PLAN, "microbatches": 2}
    ref = _feedforward_reference(2)
    results = run_distributed(_train_feedforward, 2, args=(config, ref["saved"]), timeout=120)
    for got in results:
        for i, want in ref["saved"]["state"].items():
            for key, value in want.items():
                torch.testing.assert_close(got["saved"]["state"][i][key], value, **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
