"""The runtime's partition under tensor parallelism is solved on one TP rank's share of
the whole model's profile (``mpar.runtime._local_stages``): split units weigh 1/tp, replicated
ones whole, and the memory cap is checked against one TP rank's bytes. Pure: a meta
model, profiled in meta mode, no processes."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mpar.config import config_from_dict
from mpar.errors import PartitionError
from mpar.meta import find_units_meta
from mpar.partition._tp_share import tp_share
from mpar.profile import profile_model
from mpar.runtime._local_stages import _decide_boundaries
from mpar.tensor_parallel import measure_tp_splits, plan_layout, resolve_plan
from mpar.topology import make_grid

D, F = 256, 1024
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class Split(nn.Module):
    """An MLP the plan splits (``up`` by its outputs, ``down`` by its inputs)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def whole(hidden: int) -> nn.Module:
    """The same MLP under names the plan does not match: replicated over TP."""
    return nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, D))


class Net(nn.Module):
    """One split unit three times the size of each of three replicated ones."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Split(3 * F), whole(F), whole(F), whole(F)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _setup(tp: int, **config):
    with torch.device("meta"):
        model = Net()
    x = torch.zeros(2, D)
    cfg = config_from_dict(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "tensor_parallel_degree": tp,
            "optimize": "memory",
            "memory_weight": 1.0,
            **({"tp_plan": PLAN} if tp > 1 else {}),
            **config,
        }
    )
    grid = SimpleNamespace(topology=make_grid(2 * tp, 2, tp_size=tp))  # pp 2 x tp, dp 1
    st = SimpleNamespace(config=cfg, grid=grid, device=torch.device("cpu"))
    layout = None
    if tp > 1:  # as DistributedModel checks it when the model is wrapped
        plan, source = resolve_plan(model, cfg.tp_plan)
        layout = plan_layout(model, plan, tp, source)
    units = find_units_meta(model, (x,), {})
    assert units == [f"layers.{i}" for i in range(4)]
    return model, x, units, st, layout


def test_split_units_weigh_half_at_tp2_and_replicated_ones_whole():
    model, x, units, _st, layout = _setup(2)
    profile = profile_model(model, (x,), units=units, mode="meta")
    half = tp_share(profile, measure_tp_splits(model, profile, layout, ((x,), {})), 2)
    split_w = 2 * D * 3 * F + 3 * F  # up's weight and bias, down's weight
    down_bias = D  # rowwise bias: whole on every rank
    first, rank = profile.units[0], half.units[0]
    assert first.param_count == split_w + down_bias
    assert rank.param_count == split_w // 2 + down_bias
    assert rank.state_bytes == (4 + 4 + 8) * (split_w // 2 + down_bias)  # Adam: p, g, 2 moments
    assert rank.flops < first.flops and rank.time_s < first.time_s
    assert rank.tp_comm_bytes > 0  # down's output all-reduced, up's input gradient too
    for whole, same in zip(profile.units[1:], half.units[1:]):
        assert (same.state_bytes, same.flops, same.tp_comm_bytes) == (
            whole.state_bytes,
            whole.flops,
            0,
        )


def test_boundaries_move_when_the_split_unit_halves():
    """Memory-balanced over two ranks: at tp 1 the split unit (3 x) is a stage alone
    against the three others; at tp 2 it weighs 1.5 x and takes one of them along."""
    boundaries = {}
    for tp in (1, 2):
        model, x, units, st, layout = _setup(tp)
        boundaries[tp], plan = _decide_boundaries(model, (x,), {}, units, st, layout)
        assert plan.tensor_parallel_degree == tp
    assert boundaries == {1: [0, 1], 2: [0, 2]}


def test_the_memory_cap_is_checked_against_one_tp_ranks_bytes():
    """A cap between one TP rank's need at tp 2 and the whole model's need per stage
    at tp 1: accepted at tp 2, refused at tp 1 with the planner's message."""
    need = {}
    for tp in (1, 2):  # what the cap is checked against: the process and a stage's memory
        model, x, units, st, layout = _setup(tp)
        _, plan = _decide_boundaries(model, (x,), {}, units, st, layout)
        need[tp] = plan.process_bytes + max(s.memory_bytes for s in plan.stages)
    assert need[2] < 0.9 * need[1]
    cap = (need[1] + need[2]) // 2
    model, x, units, st, layout = _setup(2, device_memory=cap)
    boundaries, plan = _decide_boundaries(model, (x,), {}, units, st, layout)
    assert boundaries == [0, 2] and plan.device_memory == cap
    model, x, units, st, layout = _setup(1, device_memory=cap)
    with pytest.raises(PartitionError, match="no split into 2 stages fits a memory cap of"):
        _decide_boundaries(model, (x,), {}, units, st, layout)


def test_measuring_leaves_no_graph_behind():
    """``measure_tp_splits`` runs the whole model with autograd on; nothing of that forward
    may outlive it, not even until Python's cycle collector runs: a parameter's gradient
    accumulator kept alive keeps its whole shape, which the TP layout changes next."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, D)
    units = [f"layers.{i}" for i in range(4)]
    profile = profile_model(model, (x,), units=units, repeats=1, warmup=0)
    plan, source = resolve_plan(model, PLAN)
    layout = plan_layout(model, plan, 2, source)
    weight = model.layers[0].down.weight
    gc.disable()
    try:
        splits = measure_tp_splits(model, profile, layout, ((x,), {}))
        weight.data = weight.data[:, : 3 * F // 2].clone()  # the piece apply_layout keeps
        nn.functional.linear(torch.randn(2, 3 * F // 2), weight).sum().backward()
    finally:
        gc.enable()
    assert weight.grad is not None and weight.grad.shape == weight.shape
    assert 0 < splits.units["layers.0"].saved_split < 1  # the activations were measured
