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
