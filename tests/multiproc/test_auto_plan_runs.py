"""The configuration ``mpar.partition.search`` picks runs as is and trains transparently."""

from __future__ import annotations

import pytest
import torch

from mpar.config import load_config
from mpar.partition import SearchSpace, plan_inputs, search
from mpar.profile import profile_model
from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import BATCH, batch, reference, tiny_gpt, train_ranks


@pytest.mark.slow
def test_auto_plan_config_runs_as_is():
    x, _ = batch("gpt", 0, size=1)
    profile = profile_model(tiny_gpt(), (x,), repeats=1, warmup=0)
    space = SearchSpace(precisions=("fp32",), max_virtual_stages=2)
    base = plan_inputs(load_config({"device_memory": "64MiB"}), 2, device="cpu")
    result = search(profile, base, global_batch=BATCH, space=space, top=3)
    config = result.best.config()
    load_config(config).check_world_size(2)
    ranks = run_distributed(train_ranks, world_size=2, args=(config, "gpt", "sgd", 2), timeout=180)
    ref = reference("gpt", "sgd", 2)
    for got in ranks:
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)


def _train_auto(config):
    import mpar

    out = train_ranks(config, "gpt", "sgd", 2)
    resolved = out.pop("config")  # the model's: resolved at its first step
    out["init_auto"] = mpar.config().auto_keys  # what mpar.init was given is kept
    out["resolved"] = (
        resolved.microbatches,
        resolved.zero.stage,
        resolved.activation_checkpointing,
        resolved.auto_keys,
    )
    return out


@pytest.mark.slow
def test_auto_values_resolve_at_the_first_step_and_train_transparently():
    config = {
        "pipeline_parallel_degree": 2,
        "microbatches": "auto",
        "zero": {"stage": "auto"},
        "activation_checkpointing": "auto",
        "device_memory": "256MiB",
    }
    ranks = run_distributed(_train_auto, world_size=2, args=(config,), timeout=180)
    ref = reference("gpt", "sgd", 2)
    resolved = {r["resolved"] for r in ranks}
    assert len(resolved) == 1  # every rank runs the same choice
    m, _zero, ckpt, auto = resolved.pop()
    assert BATCH % m == 0 and ckpt in (False, True, "block") and auto == ()
    assert all(r["init_auto"] for r in ranks)
    for got in ranks:
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
