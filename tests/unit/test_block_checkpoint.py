"""Per-block activation checkpointing without processes: the config values, the
traced-graph pass (same outputs and gradients, less saved), the selective policy, and
what the planner makes of each strategy (issue 44)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpar.config import BlockCheckpointing, config_from_dict
from mpar.errors import ConfigError, ConfigTypeError
from mpar.partition import find_units, split_module
from mpar.partition._block_checkpoint import chosen_units, selective_policy
from mpar.partition._plan_inputs import config_dict, plan_inputs
from mpar.runtime._recompute import checkpoint_blocks
from mpar.testing.models import GPTConfig, TinyGPT


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("block", BlockCheckpointing()),
        ("selective", BlockCheckpointing("selective")),
        ({"mode": "block", "every": 2}, BlockCheckpointing("block", 2)),
        ({"every": 3}, BlockCheckpointing("block", 3)),
        (True, None),
        ("each", None),
        (False, None),
    ],
)
def test_config_values(value, expected):
    config = config_from_dict({"activation_checkpointing": value})
    assert config.block_checkpointing == expected
    assert config.checkpointing is (value is not False)
    assert config.chunk_checkpointing is (value in (True, "each"))
    assert config_from_dict(config.to_dict()) == config  # the dict form round-trips


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("blocks", ConfigError, "'block', 'selective'"),
        ({"mode": "blok"}, ConfigError, "'activation_checkpointing.mode' has value 'blok'"),
        ({"every": 0}, ConfigError, "'activation_checkpointing.every' has value 0"),
        ({"every": "2"}, ConfigTypeError, "must be an integer"),
        ({"evry": 2}, ConfigError, "did you mean 'every'"),
    ],
)
def test_config_errors_name_the_value_and_the_choices(value, error, match):
    with pytest.raises(error, match=match):
        config_from_dict({"activation_checkpointing": value})


def test_every_k_counts_from_each_stages_first_unit():
    units = [f"u{i}" for i in range(7)]
    assert chosen_units(units, BlockCheckpointing("block", 3)) == ["u0", "u3", "u6"]
    assert chosen_units(units, BlockCheckpointing()) == units


@pytest.fixture(scope="module")
def traced() -> tuple[list[torch.nn.Module], list[list[str]], torch.Tensor]:
    """TinyGPT cut into two traced stages (exported once for every test here)."""
    torch.manual_seed(0)
    net = TinyGPT(GPTConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=4, max_seq_len=8))
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    units = find_units(net, (idx,), {})
    split = split_module(net, (idx,), {}, [0, 4], units=units)
    return split.stages, split.units, idx


class _Counts(TorchDispatchMode):
    """Matrix products run while inside."""

    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.products += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _run(traced, strategy):
    """Loss, gradients, bytes the forward saved outside the checkpointed regions, and
    the matrix products the backward ran (recomputed ones included)."""
    stages, units, idx = traced
    if strategy is not None:
        for stage, names in zip(stages, units):
            checkpoint_blocks(stage, names, strategy)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stages[1](*stages[0](idx))
    loss = out.square().mean()
    with _Counts() as counts:
        loss.backward()
    grads = [p.grad.clone() for s in stages for p in s.parameters() if p.grad is not None]
    return loss.detach(), grads, saved[0], counts.products


def test_traced_stages_recompute_block_by_block_with_the_same_gradients(traced):
    loss, grads, whole, products = _run(traced, None)  # first: nothing checkpointed yet
    results = {}
    for name, strategy in {
        "every2": BlockCheckpointing("block", 2),
        "block": BlockCheckpointing(),
        "selective": BlockCheckpointing("selective"),
    }.items():
        got_loss, got_grads, saved, recomputed = _run(traced, strategy)
        torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
        assert len(got_grads) == len(grads)
        for a, b in zip(got_grads, grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        results[name] = (saved, recomputed)
        assert all(s.code.count("run_region(") >= 1 for s in traced[0])
    # what the forward keeps: every block < every other block < everything
    assert results["block"][0] < results["every2"][0] < whole, results
    # the backward reruns the forward's products under "block", not under "selective"
    assert results["block"][1] > products, (results, products)
    assert results["selective"][1] == products, (results, products)


def test_selective_keeps_matrix_products_and_recomputes_attention_scores():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    a, w = torch.empty(4, 8), torch.empty(8, 16)
    assert selective_policy(None, aten.mm.default, a, w) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, aten.gelu.default, a) == CheckpointPolicy.PREFER_RECOMPUTE
    q, k = torch.empty(2, 64, 8), torch.empty(2, 8, 64)  # scores: 64 x 64 per head
    assert selective_policy(None, aten.bmm.default, q, k) == CheckpointPolicy.PREFER_RECOMPUTE
    scores, v = torch.empty(2, 64, 64), torch.empty(2, 64, 8)  # scores @ v: small
    assert selective_policy(None, aten.bmm.default, scores, v) == CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize(
    ("value", "planned"),
    [
        (True, True),
        ("block", "block"),
        ({"mode": "block", "every": 2}, BlockCheckpointing("block", 2)),
        ("selective", BlockCheckpointing("selective")),
    ],
)
def test_the_planner_models_the_strategy_the_runtime_runs(value, planned):
    config = config_from_dict({"activation_checkpointing": value})
    inputs = plan_inputs(config, 1, device="cpu")
    assert inputs.activation_checkpointing == planned
    back = config_from_dict(config_dict(inputs))
    assert back.block_checkpointing == config.block_checkpointing


def test_planned_activation_bytes_follow_the_strategy():
    from mpar.partition._memory_model import MemoryLayout, unit_held_bytes
    from mpar.profile import UnitProfile

    unit = UnitProfile(
        name="b", param_count=0, param_bytes=0, grad_bytes=0, optimizer_bytes=0, flops=0,
        time_s=0.0, activation_bytes=1000, output_bytes=100,
    )  # fmt: skip
    held = {
        name: unit_held_bytes(unit, MemoryLayout(1, 0, "fp32", activation_checkpointing=c), 1)
        for name, c in {
            "none": False,
            "block": "block",
            "every2": BlockCheckpointing("block", 2),
            "selective": BlockCheckpointing("selective"),
        }.items()
    }
    assert held == {"none": 1000, "block": 100, "every2": 550, "selective": 500}


def test_the_plan_table_names_each_strategy():
    from mpar.partition._search import checkpointing_label

    labels = [
        checkpointing_label(c)
        for c in (
            False,
            True,
            "block",
            BlockCheckpointing("block", 2),
            BlockCheckpointing("selective"),
        )
    ]
    assert labels == ["-", "chunk", "block", "block/2", "selective"]
