"""ZeRO 0-3 (+ CPU offload) trains exactly like one process on the whole batch.

Each rank drives ``ShardedStages`` by hand, as the runtime will: unshard,
forward on its slice of the batch, ``(loss / dp).backward()``, reduce_grads,
reshard, finish_grads, step, zero_grad. The reference is a deep copy trained
with the same optimizer on the whole batch in one process. AdamW uses
``eps=1e-6``: gradients are summed in a different order than in the
reference, and Adam turns that rounding noise on near-zero gradients into
lr-sized steps unless eps dominates it.
"""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

# (stage, offload_optimizer, offload_params): every valid combination.
CONFIGS = [
    (0, "none", "none"),
    (1, "none", "none"),
    (1, "cpu", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (3, "none", "cpu"),
]
BUCKET_MB = 64 * 4 / 2**20  # 64 fp32 elements: several buckets, one split parameter


def _net():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 10)
            self.frozen = nn.Linear(10, 10)
            self.frozen.requires_grad_(False)
            self.b = nn.Linear(10, 7)  # 77 parameters: not divisible by 2 or 4
            self.c = nn.Linear(7, 3)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            h = torch.tanh(self.frozen(h))
            return self.c(torch.tanh(self.b(h)))

    torch.manual_seed(0)
    return Net()


def _batch(step):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _optimizer(kind, params):
    import torch

    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.1)


def _reference(kind, steps):
    import torch

    net = _net()
    opt = _optimizer(kind, net.parameters())
    for step in range(steps):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net


def _train_sharded(zero, kind, steps, reshard):
    import torch

    import mpar
    from mpar.shard import ShardedStages

    st = mpar.comm.state()
    dp, r = len(st.grid.dp_ranks), st.grid.dp_rank
    net = _net()
    sharded = ShardedStages(
        {0: net},
        zero,
        group=st.grid.dp_group,
        group_ranks=st.grid.dp_ranks,
        rank_in_group=r,
        device=st.device,
    )
    opt = sharded.wrap_optimizer(_optimizer(kind, net.parameters()))
    for step in range(steps):
        x, y = _batch(step)
        rows = slice(r * 8 // dp, (r + 1) * 8 // dp)
        sharded.unshard(0)
        loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows]) / dp
        loss.backward()
        sharded.reduce_grads(0)
        if reshard:
            sharded.reshard(0)
        sharded.finish_grads()
        opt.step()
        opt.zero_grad()
    sharded.unshard(0)
    return net, sharded, opt


def _check_configs(configs, kind, steps):
    import torch

    import mpar
    from mpar.config import ZeroConfig

    mpar.init({"timeout_s": 60})
    expected = _reference(kind, steps).state_dict()
    for stage, offload_opt, offload_params in configs:
        zero = ZeroConfig(stage, offload_opt, offload_params, bucket_mb=BUCKET_MB)
        net, _, _ = _train_sharded(zero, kind, steps, reshard=stage == 3)
        for name, value in net.state_dict().items():
            torch.testing.assert_close(
                value,
                expected[name],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name, z=zero: f"{z} {n}: {m}",
            )
    return len(configs)


@pytest.mark.parametrize("dp", [2, 4])
def test_adamw_every_zero_stage_and_offload_matches_one_process(dp):
    results = run_distributed(_check_configs, dp, args=(CONFIGS, "adamw", 3), timeout=120)
    assert results == [len(CONFIGS)] * dp


def test_sgd_momentum_zero2_and_zero3_offload_match_one_process():
    configs = [(2, "none", "none"), (3, "cpu", "cpu")]
    results = run_distributed(_check_configs, 2, args=(configs, "sgd", 3), timeout=90)
    assert results == [2, 2]


def _overlapped(stages):
    import torch

    import mpar
    from mpar.config import ZeroConfig
    from mpar.shard import ShardedStages

    mpar.init({"timeout_s": 60})
    st = mpar.comm.state()
    dp, r = len(st.grid.dp_ranks), st.grid.dp_rank
    expected = _reference("adamw", 2).state_dict()
    started = []
    for stage in stages:
        net = _net()
        zero = ZeroConfig(stage, bucket_mb=BUCKET_MB)
        sharded = ShardedStages(
            {0: net},
            zero,
            group=st.grid.dp_group,
            group_ranks=st.grid.dp_ranks,
            rank_in_group=r,
            device=st.device,
        )
        opt = sharded.wrap_optimizer(_optimizer("adamw", net.parameters()))
        for step in range(2):
            x, y = _batch(step)
            rows = slice(r * 8 // dp, (r + 1) * 8 // dp)
            sharded.unshard(0)
            for half, last in ((slice(0, 2), False), (slice(2, 4), True)):  # two microbatches
                if last:
                    sharded.reduce_grads_in_backward(0)
                out = net(x[rows][half])
                (torch.nn.functional.mse_loss(out, y[rows][half]) / dp / 2).backward()
            started.append(all(b.grads.pending is not None for b in sharded.buckets))
            sharded.reduce_grads(0)
            sharded.finish_grads()
            opt.step()
            opt.zero_grad()
        sharded.unshard(0)
        for name, value in net.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    return started


def test_reductions_start_during_the_last_backward_and_stay_exact():
    results = run_distributed(_overlapped, 2, args=([1, 2, 3],), timeout=90)
    assert results == [[True] * 6] * 2  # every bucket was in flight before reduce_grads
