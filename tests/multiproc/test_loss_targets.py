"""Microbatches and replicas that keep different numbers of targets (rows padded with
labels -100) weigh their token-mean losses by those numbers: the step's losses,
gradients and parameters are one process's on the whole batch. Hugging Face causal LMs
(their own loss, shifting the labels) and a loss the step function computes alike."""

from __future__ import annotations

import functools

import pytest

from mpar.testing import run_distributed
from tests.multiproc import _cp_cases as cases

pytest.importorskip("transformers")

STEPS = 2
SLOW = pytest.mark.slow


def _run_each(world, jobs):
    results = run_distributed(cases.train_each, world, args=(jobs, STEPS), timeout=600)
    for i, (_, family, kind) in enumerate(jobs):
        cases.check([r[i] for r in results], cases.reference(family, STEPS, kind=kind))


def test_padded_rows_over_microbatches_replicas_and_stages():
    """dp 2 with 2 microbatches each (a Hugging Face Llama's own loss, and a plain
    GPT's loss computed in the step); pp 2 with 4 microbatches under NCCL's rules."""
    pp = {"pipeline_parallel_degree": 2, "microbatches": 4, "nccl_rules": True}
    _run_each(
        2,
        [
            ({"microbatches": 2}, "llama", "padded"),
            ({"microbatches": 2}, "gpt", "padded"),
            (pp, "mistral", "padded"),
        ],
    )


@pytest.mark.parametrize(
    ("world", "config", "family"),
    [
        pytest.param(
            4,
            {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}},
            "llama",
            marks=SLOW,
            id="pp2-dp2-zero3",
        ),
        pytest.param(
            4,
            {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "zero_bubble"},
            "qwen2",
            marks=SLOW,
            id="pp2-dp2-zero_bubble",
        ),
        pytest.param(
            2, {"tensor_parallel_degree": 2, "microbatches": 2}, "llama", marks=SLOW, id="tp2"
        ),
        pytest.param(
            4,
            {"cp": 2, "pipeline_parallel_degree": 2, "microbatches": 4, "virtual_stages": 2},
            "mistral",
            marks=SLOW,
            id="cp2-pp2-virtual",
        ),
        pytest.param(2, {"cp": 2, "microbatches": 2}, "gpt", marks=SLOW, id="cp2-step-loss"),
    ],
)
def test_grid(world, config, family):
    # logits not compared: under CP the plain GPT (no attention_mask of its own) has
    # its padding masked, which changes the padded positions' logits, not the loss
    body = functools.partial(cases.train, kind="padded")
    results = run_distributed(body, world, args=(config, family, STEPS), timeout=600)
    cases.check(results, cases.reference(family, STEPS, kind="padded"))


def _with_num_items():
    import torch

    import mpar
    from mpar.errors import StepError

    mpar.init({"microbatches": 2})
    model = mpar.DistributedModel(cases.build("llama"))
    inputs = cases.batch("llama", 0, kind="padded")

    @mpar.step
    def train_step(m, batch):
        out = m(**batch, num_items_in_batch=torch.tensor(10))
        m.backward(out.loss)
        return out.loss

    try:
        train_step(model, inputs)
    except StepError as exc:
        return str(exc)
    finally:
        mpar.shutdown()
    return "no error"


def test_num_items_in_batch_from_the_user_is_refused():
    """Hugging Face Trainer's habit: the loss would be a sum over a count of the user's
    while mpar weighs by kept targets too (counted twice)."""
    (message,) = run_distributed(_with_num_items, 1, timeout=120)
    assert "drop num_items_in_batch from the model call" in message
