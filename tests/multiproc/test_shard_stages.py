"""Two pipeline stages on one rank sharing a parameter, and several param groups."""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed


def _model():
    import torch
    from torch import nn

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 6)
            self.tied = nn.Linear(6, 6, bias=False)

        def forward(self, x):
            return torch.tanh(self.tied(torch.tanh(self.lin(x))))

    class Second(nn.Module):
        def __init__(self, tied: nn.Linear) -> None:
            super().__init__()
            self.head = nn.Linear(6, 6, bias=False)
            self.head.weight = tied.weight  # the same Parameter on both stages
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            return self.out(torch.tanh(self.head(x)))

    torch.manual_seed(0)
    first = First()
    return nn.Sequential(first, Second(first.tied))


def _optimizer(model):
    import torch

    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, eps=1e-6)


def _batch(step):
    import torch

    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _two_stages(stage, offload):
    import torch

    import mpar
    from mpar.config import ZeroConfig
    from mpar.shard import ShardedStages

    mpar.init({"timeout_s": 60})
    st = mpar.comm.state()
    dp, r = len(st.grid.dp_ranks), st.grid.dp_rank
    reference = _model()
    ref_opt = _optimizer(reference)
    model = _model()
    stages = {0: model[0], 2: model[1]}  # as a rank holding chunks 0 and 2 would
    zero = ZeroConfig(stage, offload, "none", bucket_mb=40 * 4 / 2**20)
    sharded = ShardedStages(
        stages,
        zero,
        group=st.grid.dp_group,
        group_ranks=st.grid.dp_ranks,
        rank_in_group=r,
        device=st.device,
    )
    opt = sharded.wrap_optimizer(_optimizer(model))
    for step in range(3):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rows = slice(r * 8 // dp, (r + 1) * 8 // dp)
        for half in (slice(0, 2), slice(2, 4)):  # two microbatches
            xm, ym = x[rows][half], y[rows][half]
            sharded.unshard(0)
            h = stages[0](xm)
            sharded.unshard(2)
            loss = torch.nn.functional.mse_loss(stages[2](h), ym) / dp / 2
            loss.backward()
        sharded.reduce_grads(2)
        sharded.reshard(2)  # the tied weight stays gathered: stage 0 still holds it
        assert model[1].head.weight.shape == (6, 6)
        sharded.reduce_grads(0)
        sharded.reshard(0)
        sharded.finish_grads()
        opt.step()
        opt.zero_grad()
    sharded.unshard(0)
    sharded.unshard(2)
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    return sorted(len(g["params"]) for g in opt.param_groups)


@pytest.mark.parametrize(("stage", "offload"), [(1, "none"), (2, "cpu"), (3, "none")])
def test_two_local_stages_with_a_shared_parameter_match_one_process(stage, offload):
    results = run_distributed(_two_stages, 2, args=(stage, offload), timeout=90)
    assert all(sum(groups) >= 2 for groups in results)  # both groups have segments somewhere
