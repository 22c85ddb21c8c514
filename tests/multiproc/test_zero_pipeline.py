"""ZeRO 0-3 (with and without CPU offload) composed with pipeline and data parallelism.

Through the public API: parameters (and losses, outputs, gradients) after 3
AdamW steps equal the unsharded single-process whole-batch reference (fp32).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import (
    BATCH,
    batch,
    loss_fn,
    mlp,
    reference,
    start_training,
    train_ranks,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}

ZERO = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 1, "offload_optimizer": "cpu"},
    {"stage": 2},
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 3},
    {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
]
LAYOUTS = [(1, 2), (2, 2), (1, 4), (2, 4)]


def _id(zero):
    return "z{stage}".format(**zero) + "".join(
        f"-{k.split('_')[1]}" for k, v in zero.items() if k != "stage" and v == "cpu"
    )


@pytest.mark.parametrize("zero", ZERO, ids=_id)
@pytest.mark.parametrize(("pp", "dp"), LAYOUTS, ids=lambda v: str(v))
def test_zero_with_pipeline_is_transparent(pp, dp, zero):
    """Every ZeRO setting (offload off and on) at pp {1, 2} x dp {2, 4}."""
    config = {"pipeline_parallel_degree": pp, "microbatches": 2, "zero": zero}
    results = run_distributed(
        train_ranks, pp * dp, args=(config, "mlp", "adamw", 3, 0.5), timeout=180
    )
    ref = reference("mlp", "adamw", 3, clip=0.5)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)


OFFLOADED_ZERO3 = ZERO[-1]


@pytest.mark.parametrize(
    "zero",
    [OFFLOADED_ZERO3, *(pytest.param(z, marks=pytest.mark.slow) for z in ZERO[:-1])],
    ids=_id,
)
def test_zero_with_pipeline_is_transparent_under_nccl_rules(zero):
    """pp 2 x dp 2 with the transfers through the NCCL-rules transport (``nccl_rules``)."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": zero, "nccl_rules": True}
    results = run_distributed(train_ranks, 4, args=(config, "mlp", "adamw", 3, 0.5), timeout=180)
    ref = reference("mlp", "adamw", 3, clip=0.5)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)


def _check_against_reference(results, model, config_note):
    ref = reference(model, "adamw", 3, clip=0.5)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(
                r["state"][name], tensor, **TOL, msg=f"{config_note}: {name}"
            )


@pytest.mark.parametrize(
    ("pipeline", "zero"),
    [
        ("interleaved", {"stage": 3}),
        ("interleaved", {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}),
        ("simple", {"stage": 3}),
        ("simple", {"stage": 2}),
    ],
    ids=["1f1b-z3", "1f1b-z3-offload", "gpipe-z3", "gpipe-z2"],
)
def test_zero_with_virtual_stages_and_prefetched_gathers_is_transparent(pipeline, zero):
    """Two chunks per rank: at ZeRO-3 the second chunk's gather is prefetched (started
    one compute action early, asynchronously) while the first one computes."""
    config = {
        "pipeline_parallel_degree": 2,
        "virtual_stages": 2,
        "microbatches": 4,
        "pipeline": pipeline,
        "zero": zero,
    }
    results = run_distributed(train_ranks, 4, args=(config, "mlp", "adamw", 3, 0.5), timeout=180)
    _check_against_reference(results, "mlp", f"{pipeline} {zero}")


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 3}], ids=_id)
def test_zero_with_parameters_tied_across_pipeline_ranks_is_transparent(zero):
    """TinyGPT ties its LM head to the embedding: at pp=2 the two copies live on
    different ranks, each sharded over its own data-parallel group."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": zero}
    results = run_distributed(train_ranks, 4, args=(config, "gpt", "adamw", 3, 0.5), timeout=180)
    _check_against_reference(results, "gpt", str(zero))


def _schedule_text(config):
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(mlp())

    @mpar.step
    def evaluate(m, x):
        return m(x)

    evaluate(model, batch("mlp", 0, BATCH // mpar.dp_size())[0])
    return [str(a) for a in model.schedule(False).actions[mpar.pp_rank()]]


def test_the_runtime_prefetches_zero3_gathers():
    config = {"pipeline_parallel_degree": 2, "virtual_stages": 2, "microbatches": 2}
    config |= {"pipeline": "simple", "zero": {"stage": 3}}
    text = run_distributed(_schedule_text, 4, args=(config,), timeout=120)[0]
    assert text[:5] == ["0UNSHARD", "0F0", "0SEND_F0", "2UNSHARD", "0F1"]


def _gathered(reshard_after_forward):
    import mpar

    zero = {"stage": 3, "reshard_after_forward": reshard_after_forward}
    config = {"virtual_stages": 4, "pipeline": "simple", "microbatches": 2, "zero": zero}
    model, opt, train = start_training(config, lambda ps: torch.optim.SGD(ps, lr=0.1))

    x, y = batch("mlp", 0)
    shard = slice(mpar.dp_rank() * BATCH // 2, (mpar.dp_rank() + 1) * BATCH // 2)
    for _ in range(2):
        train(model, x[shard], y[shard])
        opt.step()
        opt.zero_grad()
    sharded = model.sharded
    chunks = [
        sum(b.spec.padded * 4 for b in sharded.buckets_used_by(s))
        for s in sorted(model.stages.modules)
    ]
    return {
        "peak": mpar.memory_report()["cpu"]["gathered_peak"],
        "chunks": chunks,
        "state": model.state_dict(),
    }


def test_zero3_with_one_pipeline_rank_gathers_one_chunk_at_a_time():
    """pp = 1 with 4 virtual stages (GPipe order): each chunk is gathered for its
    forwards, freed, and gathered again (prefetched) for its backwards, so at most
    the chunk in use and the next one are whole at once (FSDP2's
    reshard_after_forward); with it off, the whole model stays gathered for the step."""
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch("mlp", 0)
    for _ in range(2):
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    for flag in (True, False):
        for r in run_distributed(_gathered, 2, args=(flag,), timeout=120):
            for name, tensor in net.state_dict().items():
                torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)
            chunks = r["chunks"]
            assert len(chunks) == 4
            if flag:
                pairs = max(a + b for a, b in itertools.pairwise(chunks))
                assert r["peak"] <= pairs < sum(chunks), (r["peak"], chunks)
            else:
                assert r["peak"] == sum(chunks), (r["peak"], chunks)


def _memory(zero_stage):
    import mpar

    config = {"microbatches": 2, "zero": {"stage": zero_stage}}
    model, opt, train = start_training(config, lambda ps: torch.optim.AdamW(ps, lr=1e-3))

    x, y = batch("mlp", 0, BATCH // mpar.dp_size())
    train(model, x, y)
    opt.step()
    report = mpar.memory_report()["cpu"]
    psi = sum(p.numel() for p in mlp().parameters())
    return report, psi, mpar.dp_size()


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_memory_report_follows_the_zero_formulas(zero_stage):
    results = run_distributed(_memory, 2, args=(zero_stage,), timeout=120)
    for report, psi, n in results:
        pad = 4 * n * 2  # < n elements of padding per buffer, fp32
        step_counter = 4 * 8  # AdamW keeps a 4-byte step tensor per parameter (8 here)
        expected = {
            0: (4 * psi, 4 * psi, 8 * psi),
            1: (4 * psi, 4 * psi / n, 8 * psi / n),  # full gradients only until reduced
            2: (4 * psi, 4 * psi / n, 8 * psi / n),
            3: (4 * psi / n, 4 * psi / n, 8 * psi / n),
        }[zero_stage]
        got = (report["parameters"], report["gradients"], report["optimizer"])
        for value, want in zip(got, expected):
            assert want <= value <= want + pad + step_counter, (zero_stage, got, expected)
        assert report["activations"] >= 0
