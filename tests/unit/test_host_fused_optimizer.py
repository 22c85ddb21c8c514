"""The host optimizer of an offloaded accelerator run steps with torch's fused CPU
kernel (``mpar.shard._sharded_optimizer.fuses_on_host``): chosen only where the user
left the choice open, and the same update as the optimizer the user built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mpar.shard._sharded_optimizer import _rebuild, fuses_on_host


def _sharded(device: str, master_device: str = "cpu") -> SimpleNamespace:
    bucket = SimpleNamespace(master=torch.zeros(4, device=master_device))
    return SimpleNamespace(device=torch.device(device), buckets=[bucket])


def _opt(cls: type[torch.optim.Optimizer], **kwargs: object) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_offloaded_state_of_an_accelerator_run_steps_fused(cls):
    assert fuses_on_host(_opt(cls), _sharded("cuda"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "opt, sharded",
    [
        (lambda: _opt(torch.optim.AdamW), lambda: _sharded("cpu")),  # a CPU run: unchanged
        (lambda: _opt(torch.optim.AdamW, foreach=True), lambda: _sharded("cuda")),  # user's pick
        (lambda: _opt(torch.optim.AdamW, fused=False), lambda: _sharded("cuda")),
        (lambda: _opt(torch.optim.RMSprop), lambda: _sharded("cuda")),  # no fused CPU kernel
    ],
)
def test_the_fused_kernel_is_not_imposed(opt, sharded):
    assert not fuses_on_host(opt(), sharded())  # type: ignore[arg-type]


def test_the_fused_host_step_is_the_users_update():
    torch.manual_seed(0)
    start, grads = torch.randn(1000), [torch.randn(1000) for _ in range(3)]
    user = _opt(torch.optim.AdamW, weight_decay=0.01)
    results = []
    for fused in (False, True):
        param = torch.nn.Parameter(start.clone())
        groups = [{**{k: v for k, v in user.param_groups[0].items() if k != "params"},
                   "params": [param]}]  # fmt: skip
        opt = _rebuild(user, groups, fused)
        assert bool(opt.param_groups[0]["fused"]) is fused
        for g in grads:
            param.grad = g.clone()
            opt.step()
        results.append(param.detach())
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("offload", [False, True])
def test_stepping_bucket_by_bucket_is_the_same_update(offload):
    """``ShardedOptimizer.by_bucket`` (on with the fused host kernel: each bucket is
    published while the host steps the next) gives the values of one whole step, with
    two weight-decay groups whose parameters share buckets, over several steps."""
    from torch import nn

    from mpar.config import ZeroConfig
    from mpar.shard import ShardedStages

    results = []
    for by_bucket in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Linear(5, 2))
        zero = ZeroConfig(
            1, bucket_mb=40 * 4 / 2**20, **({"offload_optimizer": "cpu"} if offload else {})
        )
        sharded = ShardedStages(
            {0: model}, zero, group=None, group_ranks=[0], rank_in_group=0, device="cpu"
        )
        assert len(sharded.buckets) > 2  # small buckets: several steps and publishes
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        user = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=0.05
        )
        opt = sharded.wrap_optimizer(user)
        opt.by_bucket = by_bucket
        x = torch.randn(8, 6)
        for _ in range(3):
            model(x).square().mean().backward()
            sharded.reduce_grads(0)
            sharded.finish_grads()
            opt.step()
            opt.zero_grad()
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
