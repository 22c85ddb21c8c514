"""Expert parallelism without processes: config, the grid's ep groups, finding experts
modules, the layout checks, and the dispatch operators and balance loss on a group of
one rank (their backward formulas against plain autograd)."""

from __future__ import annotations

import copy

import pytest
import torch

from mpar.comm._ep_ops import clear_ep_groups, register_ep_group
from mpar.config import config_from_dict
from mpar.errors import ConfigError, ConfigTypeError
from mpar.expert_parallel import (
    EPPlanError,
    apply_ep_layout,
    find_experts,
    plan_ep_layout,
    router_aux_loss,
)
from mpar.testing.models import MOE_EP_PLAN, MoEConfig, TinyMoE
from mpar.topology import make_grid

GROUP = "unit-ep"


@pytest.fixture
def one_rank():
    register_ep_group(GROUP, None, 1, 0)
    yield GROUP
    clear_ep_groups()


def _mixtral(experts=4):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32, num_local_experts=experts, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


# -- config and grid ------------------------------------------------------------------


def test_ep_alias_plan_and_checks():
    assert config_from_dict({"ep": 2}).expert_parallel_degree == 2
    with pytest.raises(ConfigError, match="'expert_parallel_degree' has value 0"):
        config_from_dict({"expert_parallel_degree": 0})
    with pytest.raises(ConfigTypeError, match="ep_plan"):
        config_from_dict({"ep_plan": ["experts"]})
    with pytest.raises(ConfigError, match="'experts' .*'replicate'"):
        config_from_dict({"ep_plan": {"blocks.*.moe": "colwise"}})
    cfg = config_from_dict({"pipeline_parallel_degree": 2, "ep": 4})
    cfg.check_world_size(16)  # dp 8: fine
    with pytest.raises(ConfigError, match=r"leaves 2 data-parallel .* in \[1, 2\]"):
        cfg.check_world_size(4)


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_ep_groups_fold_into_dp(placement):
    grid = make_grid(16, 2, placement, tp_size=2, ep_size=2)
    for rank in range(16):
        ep, edp = grid.ep_group(rank), grid.edp_group(rank)
        coords = [grid.coordinates(r) for r in ep + edp]
        me = grid.coordinates(rank)
        assert {(c.pp, c.tp, c.cp) for c in coords} == {(me.pp, me.tp, me.cp)}
        assert set(ep) & set(edp) == {rank}
        assert len(ep) == 2 and len(edp) == 2
        ep_rank, edp_rank = grid.ep_coordinates(rank)
        assert ep[ep_rank] == rank and edp[edp_rank] == rank
    for groups in (grid.ep_groups, grid.edp_groups):  # each partitions the world
        assert sorted(r for g in groups for r in g) == list(range(16))
    dp = grid.dp_group(0, 0)
    assert grid.ep_group(dp[0]) == dp[:2] and grid.edp_group(dp[0]) == dp[0::2]
    with pytest.raises(ConfigError, match="must divide the data-parallel degree 2"):
        make_grid(4, 2, ep_size=4)


# -- finding and checking experts -------------------------------------------------------


def test_hugging_face_experts_are_found_beside_their_router():
    found = find_experts(_mixtral(), None)
    assert sorted(found) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    em = found["model.layers.0.mlp.experts"]
    assert em.num_experts == 4 and em.fused == ("gate_up_proj", "down_proj")


def test_a_users_experts_need_a_plan():
    model = TinyMoE(MoEConfig())
    assert find_experts(model, None) == {}
    with pytest.raises(EPPlanError, match="ep_plan"):
        plan_ep_layout(model, 2, None)
    found = find_experts(model, MOE_EP_PLAN)
    assert found["blocks.0.experts"].listed == "experts"
    fused = find_experts(TinyMoE(MoEConfig(per_expert=False)), MOE_EP_PLAN)
    assert fused["blocks.1.experts"].fused == ("w_in", "w_out")
    with pytest.raises(EPPlanError, match="not an experts module"):
        find_experts(model, {"blocks.*.norm": "experts"})
    with pytest.raises(EPPlanError, match="match no module"):
        find_experts(model, {"layers.*.moe": "experts"})
    assert find_experts(model, {"blocks.*.experts": "replicate"}) == {}


def test_a_pipeline_never_cuts_between_one_layers_experts():
    """A ``ModuleList`` of experts is expanded into a unit per expert; under expert
    parallelism the experts module is one unit again (its forward runs them as one)."""
    from mpar.partition import find_units
    from mpar.runtime._local_stages import _experts_whole

    model = TinyMoE(MoEConfig())
    units = find_units(model, (torch.zeros(1, 4, dtype=torch.long),))
    assert "blocks.0.experts.experts.1" in units
    whole = _experts_whole(units, plan_ep_layout(model, 2, MOE_EP_PLAN))
    assert whole == [
        "embed", "blocks.0.norm", "blocks.0.experts", "blocks.1.norm", "blocks.1.experts",
        "norm", "head",
    ]  # fmt: skip
    assert _experts_whole(units, None) == units


def test_experts_must_split_over_ep():
    with pytest.raises(EPPlanError, match=r"has 4 experts.*degree 3.*\[1, 2, 4\]"):
        plan_ep_layout(TinyMoE(MoEConfig()), 3, MOE_EP_PLAN)
    layout = plan_ep_layout(_mixtral(), 2, None)
    assert layout is not None and layout.shards["model.layers.1.mlp.experts.down_proj"].dim == 0
    listed = plan_ep_layout(TinyMoE(MoEConfig()), 2, MOE_EP_PLAN)
    assert listed is not None and listed.placed["blocks.0.experts.experts.3.fc1.weight"] == 3
    assert listed.holds("blocks.0.experts.experts.3.fc1.weight", 1)
    assert not listed.holds("blocks.0.experts.experts.3.fc1.weight", 0)


# -- the operators on one rank: same values and gradients as without them --------------


def _grads(model, ids):
    out = model(input_ids=ids, labels=ids) if hasattr(model, "config") else model(ids)
    loss = out.loss if hasattr(out, "loss") else out.square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["mixtral", "listed", "fused"])
def test_dispatch_on_one_rank_changes_nothing(one_rank, kind):
    if kind == "mixtral":
        model, plan = _mixtral(), None
    else:
        torch.manual_seed(0)
        model, plan = TinyMoE(MoEConfig(per_expert=kind == "listed")), MOE_EP_PLAN
    reference = copy.deepcopy(model)
    layout = plan_ep_layout(model, 2, plan)  # split in two, then applied as rank 0 of one
    assert layout is not None
    layout.size = 1  # one rank holds every expert: the dispatch is a permutation
    layout.shards = {k: type(v)(0, 1) for k, v in layout.shards.items()}
    apply_ep_layout(model, layout, 0, one_rank)
    ids = torch.randint(0, 32, (3, 5))
    loss, grads = _grads(model, ids)
    want, want_grads = _grads(reference, ids)
    torch.testing.assert_close(loss, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_balance_loss_equals_hugging_faces(one_rank):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    logits = tuple(torch.randn(12, 4, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]])
    for m in (None, mask):
        ours = router_aux_loss(logits, 4, 2, m, group=one_rank)
        theirs = load_balancing_loss_func(logits, 4, 2, m)
        torch.testing.assert_close(ours, theirs)
        mine = torch.autograd.grad(ours, logits)
        want = torch.autograd.grad(theirs, logits)
        for a, b in zip(mine, want):
            torch.testing.assert_close(a, b)
    assert transformers is not None
