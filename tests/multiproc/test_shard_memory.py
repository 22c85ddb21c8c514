"""Bytes per rank (``memory_report``) against the ZeRO paper's model-state formulas.

fp32 parameters and AdamW, ``Psi`` parameters, ``N`` ranks (the paper's
mixed-precision K = 12 becomes 8 here: fp32 needs no master copy):

    stage 0: 4 Psi + 4 Psi + 8 Psi          stage 2: 4 Psi + (4 + 8) Psi / N
    stage 1: 4 Psi + 4 Psi + 8 Psi / N      stage 3: (4 + 4 + 8) Psi / N

Stage 1 reaches its formula during the backward; after the reduction it keeps
only this rank's gradient slice (as DeepSpeed does), so between steps it holds
stage 2's 4 Psi / N of gradients. Plus 4 bytes of AdamW's ``step`` counter per flat optimizer parameter, plus,
at stage 3, the full parameters of a stage while it is gathered. With CPU
offload the optimizer also keeps a 4 Psi / N fp32 master shard (and its
gradient) on the CPU.
"""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

PSI = 3 * (16 * 16 + 16)  # three Linear(16, 16): 816, divisible by 2 and 4


def _report(stage, offload="none", *, model=None, steps=1):
    import torch
    from torch import nn

    import mpar
    from mpar.config import ZeroConfig
    from mpar.shard import ShardedStages

    st = mpar.comm.state()
    torch.manual_seed(0)
    net = model() if model else nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    zero = ZeroConfig(stage, offload, offload if stage == 3 else "none")
    sharded = ShardedStages(
        {0: net},
        zero,
        group=st.grid.dp_group,
        group_ranks=st.grid.dp_ranks,
        rank_in_group=st.grid.dp_rank,
        device=st.device,
    )
    opt = sharded.wrap_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3))
    reports = {}
    for _ in range(steps):
        sharded.unshard(0)
        reports["gathered"] = sharded.memory_report()["cpu"]
        net(torch.randn(4, net[0].in_features)).square().mean().backward()
        reports["after_backward"] = sharded.memory_report()["cpu"]
        sharded.reduce_grads(0)
        sharded.reshard(0)
        sharded.finish_grads()
        opt.step()
        reports["after_step"] = sharded.memory_report()["cpu"]
        opt.zero_grad()
        reports["after_zero_grad"] = sharded.memory_report()["cpu"]
    return reports


def _all_stages():
    import mpar

    mpar.init({"timeout_s": 60})
    results = {stage: _report(stage) for stage in range(4)}
    results["3-offload"] = _report(3, "cpu")
    results["1-offload"] = _report(1, "cpu")
    return results


def _state(params, grads, optimizer):
    return {"parameters": params, "gradients": grads, "optimizer": optimizer}


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_rank_follow_the_zero_formulas(n):
    results = run_distributed(_all_stages, n, timeout=90)
    step = 4  # AdamW's step counter: one fp32 scalar for the single flat parameter
    for r in results:
        assert r[0]["after_step"] == _state(4 * PSI, 4 * PSI, 8 * PSI + step)
        assert r[1]["after_backward"]["gradients"] == 4 * PSI  # the paper's stage 1
        assert r[1]["after_step"] == _state(4 * PSI, 4 * PSI // n, 8 * PSI // n + step)
        assert r[2]["after_step"] == _state(4 * PSI, 4 * PSI // n, 8 * PSI // n + step)
        assert r[3]["after_step"] == _state(4 * PSI // n, 4 * PSI // n, 8 * PSI // n + step)
        # ZeRO-3 holds the whole stage only while it is gathered ...
        assert r[3]["gathered"]["parameters"] == 4 * PSI // n + 4 * PSI
        # ... and full-size gradients only between backward and reduce_grads.
        assert r[3]["after_backward"]["gradients"] == 4 * PSI
        assert r[3]["after_zero_grad"] == _state(4 * PSI // n, 0, 8 * PSI // n + step)
        # CPU offload: + the fp32 master shard; the gradient shard lives on the CPU.
        assert r["3-offload"]["after_step"] == _state(
            4 * PSI // n, 4 * PSI // n, 8 * PSI // n + step
        )
        assert r["1-offload"]["after_step"] == _state(4 * PSI, 4 * PSI // n, 12 * PSI // n + step)


def _padded():
    from torch import nn

    import mpar

    mpar.init({"timeout_s": 60})
    return _report(3, model=lambda: nn.Sequential(nn.Linear(10, 7)))["after_step"]


def test_padding_adds_fewer_than_n_elements_and_no_optimizer_state():
    results = run_distributed(_padded, 4, timeout=60)
    # 77 parameters -> padded to 80, 20 per rank; rank 3 holds 17 real ones + 3 padding.
    real = [20, 20, 20, 17]
    for r, report in enumerate(results):
        assert report == _state(4 * 20, 4 * 20, 8 * real[r] + 4)
