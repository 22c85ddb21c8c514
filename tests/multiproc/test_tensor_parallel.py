"""Tensor parallelism, alone and composed with pipeline and ZeRO, is transparent.

The oracle is one process training the whole model on the whole batch
(``_pipeline_cases.reference``). Each rank's local gradients are compared with
its TP piece of the reference gradients (``TPShard.local``), and the gathered
``state_dict`` with the reference's parameters after the last step.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mpar.testing import run_distributed
from mpar.testing_models import GPT_TP_PLAN
from tests.multiproc._pipeline_cases import reference, train_ranks

STEPS = 3
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _config(tp: int, **extra):
    return {"tensor_parallel_degree": tp, "tp_plan": GPT_TP_PLAN, "microbatches": 2, **extra}


def _check(results, ref, tol=TOL):
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **tol)
        for step, out in enumerate(r["outputs"]):
            assert_close(out, ref["outputs"][step], **tol)
        for key, value in ref["state"].items():
            assert_close(r["state"][key], value, **tol, msg=lambda m, k=key: f"{k}: {m}")
        tp_rank, _ = r["tp"]
        for step, grads in enumerate(r["grads"]):
            for name, grad in grads.items():
                want = ref["grads"][step][name]
                shard = r["tp_shards"].get(name)
                if shard is not None:
                    want = shard.local(want, tp_rank)
                assert_close(grad, want, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_alone(tp, optimizer):
    results = run_distributed(
        train_ranks, tp, args=(_config(tp), "tp_gpt", optimizer, STEPS), timeout=240
    )
    _check(results, reference("tp_gpt", optimizer, STEPS))
    shards = results[0]["tp_shards"]
    assert "blocks.0.q.weight" in shards and "blocks.0.ln_1.weight" not in shards


def test_pp2_tp2():
    results = run_distributed(
        train_ranks,
        4,
        args=(_config(2, pipeline_parallel_degree=2, microbatches=4), "tp_gpt", "sgd", STEPS),
        timeout=240,
    )
    assert sorted(r["tp"] for r in results) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    _check(results, reference("tp_gpt", "sgd", STEPS))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tp2_clip_global_norm(optimizer):
    """clip_grad_norm_ sees the one-process norm: split parameters' pieces summed over
    TP, replicated ones counted once (a small max_norm makes every step clip)."""
    results = run_distributed(
        train_ranks, 2, args=(_config(2), "tp_gpt", optimizer, STEPS, 0.05), timeout=240
    )
    _check(results, reference("tp_gpt", optimizer, STEPS, clip=0.05))


@pytest.mark.parametrize(
    "zero", [{"stage": 1}, {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}]
)
def test_tp2_dp2_zero(zero):
    results = run_distributed(
        train_ranks,
        4,
        args=(_config(2, zero=zero), "tp_gpt", "adamw", STEPS, 0.05),
        timeout=300,
    )
    assert sorted(r["dp"] for r in results) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    _check(results, reference("tp_gpt", "adamw", STEPS, clip=0.05))


@pytest.mark.parametrize(
    "extra",
    [
        {"pipeline": "zero_bubble"},
        {"pipeline": "interleaved", "virtual_stages": 2},
        {"activation_checkpointing": True},
    ],
    ids=["zero_bubble", "virtual", "checkpointing"],
)
def test_pp2_tp2_schedules(extra):
    config = _config(2, pipeline_parallel_degree=2, microbatches=4, **extra)
    results = run_distributed(train_ranks, 4, args=(config, "tp_gpt", "sgd", STEPS), timeout=300)
    _check(results, reference("tp_gpt", "sgd", STEPS))


def test_tp2_bf16():
    results = run_distributed(
        train_ranks, 2, args=(_config(2, bf16=True), "tp_gpt", "sgd", STEPS), timeout=240
    )
    ref = reference("tp_gpt", "sgd", STEPS)
    for r in results:  # bf16 compute: losses to bf16 accuracy, masters stay fp32
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)
        for key, value in ref["state"].items():
            assert r["state"][key].dtype == value.dtype
            assert_close(r["state"][key], value, rtol=5e-2, atol=5e-2)


@pytest.mark.slow
def test_pp2_tp2_dp2_zero1():
    config = _config(2, pipeline_parallel_degree=2, microbatches=4, zero={"stage": 1})
    results = run_distributed(train_ranks, 8, args=(config, "tp_gpt", "adamw", STEPS), timeout=600)
    assert sorted({r["tp"] for r in results}) == [(0, 2), (1, 2)]
    _check(results, reference("tp_gpt", "adamw", STEPS))
