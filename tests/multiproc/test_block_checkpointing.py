"""Per-block activation checkpointing (issue 44): each partition unit recomputed alone,
at any pipeline degree, transparent against one process on the whole batch.

Losses, updated parameters (SGD, so one step's update is ``-lr`` times the gradient:
the gradients are checked with them) equal the single-process run's in fp32. Under
ZeRO-3 a recomputed block runs on its unit gathered again for the backward, and
nothing stays gathered after the step.
"""

from __future__ import annotations

from typing import Any

import pytest

from mpar.testing import run_distributed

LAYERS, BATCH = 4, 8


def _gpt() -> Any:
    import torch

    from mpar.testing.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, d_model=32, num_heads=2, num_layers=LAYERS, max_seq_len=16)
    return TinyGPT(cfg)


def _tokens() -> Any:
    import torch

    return torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(3))


def _loss(logits: Any, idx: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), idx.reshape(-1))


def _reference(steps: int = 2) -> dict[str, Any]:
    import torch

    net = _gpt()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    idx, losses = _tokens(), []
    for _ in range(steps):
        loss = _loss(net(idx), idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": net.state_dict()}


def _watch_blocks() -> tuple[list[bool], Any]:
    """Record, at every eager ``Block.forward`` that autograd records (a stage that is
    the model itself; finding its units runs without gradients), whether the block's
    parameters were gathered (ZeRO-3 frees them to 0 elements)."""
    import torch

    from mpar.testing import models

    seen: list[bool] = []
    forward = models.Block.forward

    def watching(self: Any, x: Any) -> Any:
        if torch.is_grad_enabled():
            seen.append(self.qkv.weight.numel() > 0)
        return forward(self, x)

    models.Block.forward = watching  # type: ignore[method-assign]
    return seen, forward


def _train(config: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    import torch

    import mpar
    from mpar.testing import models

    seen, forward = _watch_blocks()
    mpar.init(config)
    model = mpar.DistributedModel(_gpt())
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @mpar.step
    def step(m: Any, x: Any) -> Any:
        loss = _loss(m(x), x)
        m.backward(loss)
        return loss

    n = BATCH // mpar.dp_size()
    mine = _tokens()[mpar.dp_rank() * n : (mpar.dp_rank() + 1) * n]
    losses, gathered_after = [], []
    for _ in range(steps):
        losses.append(step(model, mine).reduce_mean().item())
        units = model.sharded.units.values() if model.sharded is not None else []
        gathered_after.append(sum(u.gathered_groups() for u in units))
        opt.step()
        opt.zero_grad()
    out = {
        "losses": losses,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "checkpointed": dict(model.stages.checkpointed),
        "units": {s: model.stages.unit_names[s] for s in model.stages.modules},
        "codes": [getattr(m, "code", "") for m in model.stages.modules.values()],
        "seen": seen,
        "gathered_after": gathered_after,
    }
    mpar.shutdown()
    models.Block.forward = forward  # type: ignore[method-assign]
    return out


def _check(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    import torch

    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]))
        for key, value in reference["state"].items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-6)


BLOCKS = ["wte", "wpe", *(f"blocks.{i}" for i in range(LAYERS)), "ln_f", "head"]
PP1_ZERO3 = {"zero": {"stage": 3}, "microbatches": 2}
PP2_1F1B = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved"}
DEFAULT = {
    "pp1-zero3-dp2-block": {**PP1_ZERO3, "activation_checkpointing": "block"},
    "pp2-1f1b-every2": {**PP2_1F1B, "activation_checkpointing": {"mode": "block", "every": 2}},
    "pp1-zero3-dp2-selective": {**PP1_ZERO3, "activation_checkpointing": "selective"},
}


def _train_each(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rank body: every layout in turn in one set of processes (cheaper than one each),
    then the Hugging Face Llama at pp 1, ZeRO-3, per block."""
    from tests.multiproc import _hf_cases as cases

    out = {name: _train(config) for name, config in configs.items()}
    llama = {"zero": {"stage": 3}, "activation_checkpointing": "block"}
    out["llama"] = cases.train_ranks(["llama"], llama, 2)["llama"]
    return out


def _check_llama(results: list[dict[str, Any]]) -> None:
    import torch

    from tests.multiproc import _hf_cases as cases

    reference = cases.reference("llama", 2)
    for got in results:
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-4, atol=1e-5
        )
        for key, value in reference["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(400)
def test_block_every_k_selective_and_llama_are_transparent():
    results = run_distributed(_train_each, 2, args=(DEFAULT,), timeout=360)
    reference = _reference()
    for name in DEFAULT:
        _check([r[name] for r in results], reference)
    _check_llama([r["llama"] for r in results])
    for name in ("pp1-zero3-dp2-block", "pp1-zero3-dp2-selective"):
        for r in (r[name] for r in results):
            assert r["checkpointed"] == {0: BLOCKS}, name
            # each block ran twice per microbatch (forward, then recomputed in its
            # backward), every time on gathered parameters; 2 steps x 2 microbatches
            assert len(r["seen"]) == 2 * 2 * 2 * LAYERS and all(r["seen"]), name
            assert r["gathered_after"] == [0, 0], name  # freed again after every backward
    for r in (r["pp2-1f1b-every2"] for r in results):
        ((stage, units),) = r["units"].items()
        assert r["checkpointed"] == {stage: units[::2]}  # from the stage's first unit
        assert r["codes"][0].count("run_region(") == len(units[::2])


def _llama(config: dict[str, Any]) -> None:
    from tests.multiproc import _hf_cases as cases

    results = run_distributed(cases.train_ranks, 2, args=(["llama"], config, 2), timeout=600)
    _check_llama([r["llama"] for r in results])


GRID = [
    {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zero_bubble"},
    {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple", "virtual_stages": 2},
    {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zbv", "virtual_stages": 2},
    {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}},
    {"tensor_parallel_degree": 2},
    {"zero": {"stage": 2}, "microbatches": 2},
]
STRATEGIES = ["block", "selective", {"mode": "selective", "every": 2}]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=["block", "selective", "selective-every2"])
@pytest.mark.parametrize("layout", GRID, ids=["zb", "gpipe-v2", "zbv", "pp2-z3", "tp2", "z2"])
def test_llama_grid(layout, strategy):
    _llama({**layout, "activation_checkpointing": strategy})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_context_parallel_ring_under_nccl_rules_and_all_to_all():
    """cp 2: the ring (recomputed inside the backward, its exchanges under NCCL's rules),
    the captured plain GPT selectively, and the all-to-all."""
    from tests.multiproc import _cp_cases as cases

    jobs = [
        ({"cp": 2, "activation_checkpointing": "block", "nccl_rules": True}, "llama", "plain"),
        ({"cp": 2, "activation_checkpointing": "selective"}, "gpt", "plain"),
        (
            {"cp": 2, "activation_checkpointing": "block", "context_parallel_method": "all_to_all"},
            "qwen2",
            "plain",
        ),
    ]
    results = run_distributed(cases.train_each, 2, args=(jobs, 2), timeout=880)
    for i, (_, family, kind) in enumerate(jobs):
        cases.check([r[i] for r in results], cases.reference(family, 2, kind=kind))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_zero3():
    from tests.multiproc import _moe_cases as cases

    config = {
        "expert_parallel_degree": 2,
        "microbatches": 2,
        "zero": {"stage": 3},
        "activation_checkpointing": "block",
    }
    results = run_distributed(cases.train_ranks, 2, args=(["mixtral"], config, 2), timeout=880)
    cases.check(results, ["mixtral"], 2, 2, 2)
