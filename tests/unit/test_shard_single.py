"""``ShardedStages`` over a group of one process: no torch.distributed needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpar.config import ZeroConfig
from mpar.shard import ShardedStages


def _sharded(stage, model, **zero):
    return ShardedStages(
        {0: model},
        ZeroConfig(stage, **zero),
        group=None,
        group_ranks=[0],
        rank_in_group=0,
        device="cpu",
    )


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


@pytest.mark.parametrize(
    "zero",
    [{}, {"offload_optimizer": "cpu"}, {"offload_optimizer": "cpu", "offload_params": "cpu"}],
)
def test_zero3_in_one_process_trains_exactly_like_plain_adamw(zero):
    reference, model = _model(), _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    sharded = _sharded(3, model, **zero)
    opt = sharded.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    # a group of one has nothing to gather: its parameters stay in place, unless they
    # live on the host (offload_params), when only the flat host shard is kept
    resharded = zero.get("offload_params") == "cpu"
    assert model[0].weight.shape == ((0,) if resharded else (5, 4))
    x = torch.randn(6, 4)
    for _ in range(2):
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        sharded.unshard(0)
        model(x).square().mean().backward()
        sharded.reduce_grads(0)
        sharded.reshard(0)
        sharded.finish_grads()
        opt.step()
        opt.zero_grad()
    sharded.unshard(0)
    assert model[0].weight.shape == (5, 4)
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=0)


def test_misuse_gets_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="at least one stage"):
        ShardedStages({}, ZeroConfig(), group=None, group_ranks=[0], rank_in_group=0, device="cpu")
    with pytest.raises(ValueError, match="rank_in_group 1 is not a position"):
        ShardedStages(
            {0: model}, ZeroConfig(), group=None, group_ranks=[0], rank_in_group=1, device="cpu"
        )
    sharded = _sharded(0, model)  # stage 0: accumulating across steps needs bind_grads
    opt = sharded.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        ValueError, match=r"stage 3 is not held by this rank \(local stages: \[0\]\)"
    ):
        sharded.unshard(3)
    model(torch.randn(2, 4)).sum().backward()
    sharded.reduce_grads(0)
    with pytest.raises(RuntimeError, match="called twice before finish_grads"):
        sharded.reduce_grads(0)
    sharded.finish_grads()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"no bind_grads\(0\) set them aside"):
        sharded.reduce_grads(0)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)


def test_full_state_dict_uses_the_original_indices_and_skips_other_ranks_parameters():
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    whole[0].requires_grad_(False)
    plain = torch.optim.Adam(whole.parameters(), lr=0.1)
    local = whole[2]  # only the last layer is on this rank; the others live elsewhere
    sharded = _sharded(2, local)
    opt = sharded.wrap_optimizer(torch.optim.Adam(whole.parameters(), lr=0.1))
    local(torch.randn(2, 3)).sum().backward()
    sharded.reduce_grads(0)
    sharded.finish_grads()
    opt.step()
    state = opt.state_dict()
    assert sorted(state["state"]) == [4, 5]  # weight and bias of whole[2]
    assert state["param_groups"][0]["params"] == list(range(6))
    assert state["state"][4]["exp_avg"].shape == (2, 3)
    plain.load_state_dict(state)  # loads into the unwrapped optimizer


def test_memory_report_counts_each_storage_once_by_device():
    model = _model()
    sharded = _sharded(1, model)
    sharded.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    psi = sum(p.numel() for p in model.parameters())
    assert sharded.memory_report() == {
        "cpu": {"parameters": 4 * psi, "gradients": 0, "optimizer": 0}
    }


@pytest.mark.parametrize(
    "stage, offload_params", [(0, False), (1, False), (2, False), (3, False), (3, True)]
)
def test_a_bucket_names_where_its_parameters_are(stage, offload_params):
    from mpar.shard._bucket import Residence

    model = _model()
    expected = [p.detach().clone() for p in model.parameters()]
    sharded = _sharded(stage, model, **({"offload_params": "cpu"} if offload_params else {}))
    (bucket,) = sharded.buckets
    if not offload_params:  # below ZeRO-3, and ZeRO-3 in a group of one: nothing to gather
        assert bucket.residence is Residence.REPLICATED and not bucket.gathers
        assert sharded.flat_buffers() == [bucket.full]
        sharded.unshard(0)
        sharded.reshard(0)
        assert bucket.residence is Residence.REPLICATED and model[0].weight.shape == (5, 4)
        return
    assert bucket.residence is Residence.SHARDED and sharded.flat_buffers() == []
    sharded.unshard(0)
    assert bucket.residence is Residence.GATHERED
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0)
    sharded.reshard(0)
    assert bucket.residence is Residence.SHARDED
    assert model[0].weight.shape == (0,) and bucket.full.untyped_storage().nbytes() == 0
    assert sharded.flat_buffers() == [bucket.full]  # freed, but the same storage comes back


@pytest.mark.parametrize("offload", [False, True])
def test_a_buckets_gradients_go_through_their_phases(offload):
    """Bound before the backward, armed for the last one (which starts the reduction
    early), reduced at REDUCE_GRAD, landed at the end of the step; held on the device
    (or, offloaded, on the host) until zero_grad."""
    from mpar.shard._bucket_grads import GradPhase, Held

    model = _model()
    sharded = _sharded(2, model, **({"offload_optimizer": "cpu"} if offload else {}))
    (bucket,) = sharded.buckets
    grads = bucket.grads
    assert (grads.phase, grads.held) == (GradPhase.IDLE, Held.NONE)
    sharded.bind_grads(0)
    assert grads.staging is not None and grads.phase is GradPhase.IDLE
    sharded.reduce_grads_in_backward(0)
    assert grads.phase is GradPhase.ARMED
    model(torch.randn(3, 4)).sum().backward()
    assert grads.phase is GradPhase.REDUCING_EARLY  # the last gradient started it
    sharded.reduce_grads(0)
    assert grads.phase is GradPhase.REDUCING and grads.pending is not None
    sharded.finish_grads()
    assert grads.phase is GradPhase.IDLE and grads.pending is None
    assert grads.held is (Held.HOST if offload else Held.DEVICE)
    assert grads.reduced_grad() is not None
    sharded.reduce_grads(0)  # nothing bound: REDUCE_GRAD starts the reduction itself
    with pytest.raises(RuntimeError, match="called twice before finish_grads"):
        sharded.reduce_grads(0)
    sharded.finish_grads()
    sharded.zero_grad()
    assert grads.held is Held.NONE and grads.reduced_grad() is None
