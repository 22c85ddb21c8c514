"""Transparency of the pipeline runtime: pp x dp training equals one process.

For every layout the losses, the whole-batch outputs, the gradients and the
parameters after several optimizer steps equal the single-process, whole-batch
reference in fp32. A representative subset runs by default; the full grid of
the issue (pp 1/2/4 x dp 1/2 x simple/interleaved x v 1/2 x m 1/3/4/8) runs
with ``-m slow``, and again (pp > 1) with ``nccl_rules``: transfers through a transport
that enforces NCCL's point-to-point rules on gloo (a few cases by default).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import reference, train_ranks

STEPS = 3
# fp32, same operations in the same order within a microbatch; microbatching
# changes the summation order of gradients, hence not bit-exact.
TOL = {"rtol": 1e-5, "atol": 1e-6}
# Logits reach |10|: a last-bit difference in an updated weight (1e-7 relative)
# moves them by ~1e-6 absolute, so outputs get atol 1e-5.
OUT_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _check(results: list[dict], ref: dict) -> None:
    for rank_result in results:
        torch.testing.assert_close(
            torch.tensor(rank_result["losses"]), torch.tensor(ref["losses"]), **TOL
        )
        for got, want in zip(rank_result["outputs"], ref["outputs"]):
            torch.testing.assert_close(got, want, **OUT_TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(rank_result["state"][name], tensor, **TOL, msg=name)
        for got_step, want_step in zip(rank_result["grads"], ref["grads"]):
            for name, grad in got_step.items():  # this rank's parameters
                torch.testing.assert_close(grad, want_step[name], **TOL, msg=name)


def _valid(pp: int, dp: int, pipeline: str, v: int, m: int, model: str) -> bool:
    world = pp * dp
    if world > 4 or m * dp > 12:
        return False
    if pipeline == "interleaved" and v > 1 and m % pp:
        return False  # the looped 1F1B schedule needs m to be a multiple of pp
    units = 9 if model == "mlp" else 8
    return pp * v <= units


def _run(pp, dp, pipeline, v, m, model, optimizer, clip=None, **extra):
    config = {
        "pipeline_parallel_degree": pp,
        "microbatches": m,
        "pipeline": pipeline,
        "virtual_stages": v,
        **extra,
    }
    results = run_distributed(
        train_ranks, pp * dp, args=(config, model, optimizer, STEPS, clip), timeout=180
    )
    _check(results, reference(model, optimizer, STEPS, clip))
    assert sorted(r["pp"] for r in results) == sorted((p, pp) for p in range(pp) for _ in range(dp))


DEFAULT = [
    # (pp, dp, pipeline, v, m, model, optimizer)
    (1, 1, "interleaved", 1, 4, "mlp", "sgd"),
    (1, 2, "interleaved", 1, 3, "mlp", "adamw"),
    (2, 1, "simple", 1, 4, "mlp", "sgd"),
    (2, 1, "interleaved", 1, 3, "mlp", "adamw"),
    (2, 2, "interleaved", 1, 4, "mlp", "adamw"),
    (2, 1, "interleaved", 2, 4, "mlp", "sgd"),
    (2, 2, "simple", 2, 3, "mlp", "adamw"),
    (4, 1, "interleaved", 1, 8, "mlp", "adamw"),
    (4, 1, "interleaved", 2, 4, "mlp", "sgd"),
    (2, 1, "interleaved", 1, 4, "gpt", "adamw"),
    (2, 2, "interleaved", 2, 2, "gpt", "sgd"),
    (2, 1, "interleaved", 1, 5, "gpt", "adamw"),  # uneven microbatches 3,3,2,2,2
]


@pytest.mark.parametrize(("pp", "dp", "pipeline", "v", "m", "model", "optimizer"), DEFAULT)
def test_transparent(pp, dp, pipeline, v, m, model, optimizer):
    _run(pp, dp, pipeline, v, m, model, optimizer)


def test_transparent_through_the_backend_without_shared_memory():
    # the default layouts above send between their ranks through shared memory
    _run(2, 2, "interleaved", 2, 4, "gpt", "adamw", shared_memory=False)


RULES = {"nccl_rules": True}
"""Transfers through the transport that enforces NCCL's point-to-point rules on gloo
(config key ``nccl_rules``): an order that would hang or mismatch on GPUs fails here."""
UNDER_RULES = [
    # (pp, dp, pipeline, v, m, model, optimizer)
    (2, 1, "interleaved", 1, 4, "mlp", "sgd"),
    (2, 2, "interleaved", 2, 4, "mlp", "adamw"),
    pytest.param(2, 2, "interleaved", 2, 4, "gpt", "adamw", marks=pytest.mark.slow),
    pytest.param(2, 1, "interleaved", 2, 4, "mlp", "sgd", marks=pytest.mark.slow),
    pytest.param(2, 1, "simple", 1, 4, "mlp", "sgd", marks=pytest.mark.slow),
    pytest.param(4, 1, "interleaved", 2, 4, "mlp", "adamw", marks=pytest.mark.slow),
    pytest.param(2, 1, "interleaved", 1, 5, "gpt", "adamw", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("pp", "dp", "pipeline", "v", "m", "model", "optimizer"), UNDER_RULES)
def test_transparent_under_nccl_rules(pp, dp, pipeline, v, m, model, optimizer):
    _run(pp, dp, pipeline, v, m, model, optimizer, **RULES)


def test_global_norm_clipping_is_transparent():
    _run(2, 2, "interleaved", 1, 2, "mlp", "sgd", clip=0.05)


FULL = [
    c
    for c in itertools.product([1, 2, 4], [1, 2], ["simple", "interleaved"], [1, 2], [1, 3, 4, 8])
    if _valid(*c, "mlp")
]


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "pipeline", "v", "m"), FULL)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_transparent_full_grid(pp, dp, pipeline, v, m, optimizer):
    _run(pp, dp, pipeline, v, m, "mlp", optimizer)


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "pipeline", "v", "m"), [c for c in FULL if c[0] > 1])
def test_transparent_full_grid_under_nccl_rules(pp, dp, pipeline, v, m):
    _run(pp, dp, pipeline, v, m, "mlp", "sgd", **RULES)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_activation_checkpointing_is_transparent(model):
    config = {
        "pipeline_parallel_degree": 2,
        "microbatches": 4,
        "activation_checkpointing": True,
        "offload_activations": True,  # a no-op on the CPU, but the path runs
    }
    results = run_distributed(train_ranks, 2, args=(config, model, "adamw", STEPS), timeout=180)
    _check(results, reference(model, "adamw", STEPS))
