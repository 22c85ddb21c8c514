"""Optimizer state dicts (full and sharded) round-trip; the global grad norm is exact."""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

BUCKET_MB = 64 * 4 / 2**20


def _setup(zero, net=None):
    import mpar
    from mpar.shard import ShardedStages
    from tests.multiproc.test_shard_transparency import _net, _optimizer

    st = mpar.comm.state()
    net = net or _net()
    sharded = ShardedStages(
        {0: net},
        zero,
        group=st.grid.dp_group,
        group_ranks=st.grid.dp_ranks,
        rank_in_group=st.grid.dp_rank,
        device=st.device,
    )
    return net, sharded, sharded.wrap_optimizer(_optimizer("adamw", net.parameters()))


def _step(net, sharded, opt, step, *, clip=None):
    import torch

    import mpar
    from mpar.comm._collectives import world_all_reduce
    from tests.multiproc.test_shard_transparency import _batch

    st = mpar.comm.state()
    dp, r = len(st.grid.dp_ranks), st.grid.dp_rank
    x, y = _batch(step)
    rows = slice(r * 8 // dp, (r + 1) * 8 // dp)
    sharded.unshard(0)
    (torch.nn.functional.mse_loss(net(x[rows]), y[rows]) / dp).backward()
    sharded.reduce_grads(0)
    sharded.reshard(0)
    sharded.finish_grads()
    norm_sq = world_all_reduce(opt.grad_sq_norm(), st.grid)
    if clip is not None:
        opt.scale_grads(clip)
    opt.step()
    opt.zero_grad()
    return norm_sq


def _params(net, sharded):
    sharded.unshard(0)
    values = {k: v.clone() for k, v in net.state_dict().items()}
    sharded.reshard(0)
    return values


def _round_trip(stage, offload):
    import copy

    import torch

    import mpar
    from mpar.config import ZeroConfig
    from tests.multiproc.test_shard_transparency import _batch, _net, _optimizer

    mpar.init({"timeout_s": 60})
    zero = ZeroConfig(stage, offload, "none", bucket_mb=BUCKET_MB)
    net, sharded, opt = _setup(zero)
    for step in range(2):
        _step(net, sharded, opt, step)
    full, saved = opt.state_dict(), _params(net, sharded)
    shards = copy.deepcopy(opt.sharded_state_dict())  # as torch.save would: it holds live tensors
    _step(net, sharded, opt, 2)
    expected = _params(net, sharded)

    # The full form is torch's: it matches a plain AdamW trained on the whole batch.
    reference = _net()
    ref_opt = _optimizer("adamw", reference.parameters())
    for step in range(2):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_state = ref_opt.state_dict()
    assert full["param_groups"] == ref_state["param_groups"]
    assert sorted(full["state"]) == sorted(ref_state["state"])
    torch.testing.assert_close(full["state"], ref_state["state"], rtol=1e-5, atol=1e-6)

    # A fresh sharded setup continues identically from either form.
    for state in (full, shards, copy.deepcopy(ref_state)):
        net2 = _net()
        net2.load_state_dict(saved)
        net2, sharded2, opt2 = _setup(zero, net2)
        opt2.load_state_dict(state)
        _step(net2, sharded2, opt2, 2)
        torch.testing.assert_close(_params(net2, sharded2), expected, rtol=1e-5, atol=1e-6)

    # The full form loads into a plain torch optimizer on the unwrapped model.
    plain = _net()
    plain.load_state_dict(saved)
    plain_opt = _optimizer("adamw", plain.parameters())
    plain_opt.load_state_dict(full)
    x, y = _batch(2)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    plain_opt.step()
    torch.testing.assert_close(plain.state_dict(), expected, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize(("stage", "offload"), [(1, "none"), (2, "cpu"), (3, "none")])
def test_state_dict_round_trips_full_and_sharded(stage, offload):
    assert run_distributed(_round_trip, 2, args=(stage, offload), timeout=90) == [True, True]


def _wrong_layout():
    import mpar
    from mpar.config import ZeroConfig

    mpar.init({"timeout_s": 60})
    _, _, opt = _setup(ZeroConfig(2, bucket_mb=BUCKET_MB))
    _, _, other = _setup(ZeroConfig(2))
    try:
        other.load_state_dict(opt.sharded_state_dict())
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_sharded_state_from_another_layout_is_refused():
    message = run_distributed(_wrong_layout, 2, timeout=60)[0]
    assert "different layout" in message and "full" in message


def _norm_and_clip(stage):
    import torch

    import mpar
    from mpar.config import ZeroConfig
    from tests.multiproc.test_shard_transparency import _batch, _net, _optimizer

    mpar.init({"timeout_s": 60})
    zero = ZeroConfig(stage, "cpu" if stage == 3 else "none", "none", bucket_mb=BUCKET_MB)
    net, sharded, opt = _setup(zero)
    reference = _net()
    ref_opt = _optimizer("adamw", reference.parameters())
    for step in range(2):
        norm_sq = _step(net, sharded, opt, step, clip=0.5)
        x, y = _batch(step)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        expected = sum(g.pow(2).sum() for g in grads)
        torch.testing.assert_close(norm_sq, expected, rtol=1e-5, atol=1e-7)
        for g in grads:
            g.mul_(0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(_params(net, sharded), reference.state_dict(), rtol=1e-5, atol=1e-6)
    return float(norm_sq)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_sq_norm_sums_to_the_full_norm_and_scaling_clips(stage):
    results = run_distributed(_norm_and_clip, 4, args=(stage,), timeout=90)
    assert len(set(results)) == 1 and results[0] > 0
