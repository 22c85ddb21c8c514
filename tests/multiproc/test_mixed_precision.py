"""bf16 / fp16 mixed precision, alone and composed with pipeline, data parallelism and ZeRO.

The oracle is ``mixed_reference``: the same recipe written out in plain torch
in one process on the whole batch (module in the low dtype, float32 loss,
float32 master copies updated by the optimizer, fp16 loss scaling with
skipped steps). With one replica and one microbatch mpar performs the very
same operations, so the results must agree bit for bit. With several
replicas or microbatches the reference splits the batch the same way and sums
the pieces' low-precision gradients in float32, as mpar does by default
(``grad_reduce_dtype: "fp32"``); the order of the sums differs, so they agree to
the compute dtype's rounding (SGD, whose update is linear in the gradient; see
DESIGN.md on Adam).
"""

from __future__ import annotations

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import (
    BATCH,
    batch,
    make_optimizer,
    mixed_reference,
    mlp,
    reference,
    start_training,
    train_ranks,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EXACT = {"bf16": {"rtol": 0.0, "atol": 0.0}, "fp16": {"rtol": 1e-6, "atol": 1e-7}}
"""fp16 folds the 1/scale unscaling and the clipping coefficient into one multiply
(the reference does two), which can move a value by an ulp."""
SUMMED = {"bf16": {"rtol": 2e-2, "atol": 1e-3}, "fp16": {"rtol": 2e-3, "atol": 1e-4}}
"""Parameters after 3 SGD steps when microbatch and replica gradients are summed in
another order than the reference's (measured with compute-dtype sums: at most 4.3e-4 /
3.0e-5 absolute; float32 sums come closer)."""
CLIPPED = {"rtol": 1e-6, "atol": 1e-7}
"""Master weights when the clipping coefficient differs from torch's by an ulp."""
LOSS_TOL = {"bf16": {"rtol": 0.0, "atol": 1e-2}, "fp16": {"rtol": 0.0, "atol": 1e-3}}


def _check(results, ref, key, tol, loss_tol):
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **loss_tol
        )
        assert r["loss_scale"] == (2.0**16 / 2 ** ref["skipped"] if key == "fp16" else 1.0)
        for name, tensor in ref["state"].items():
            assert r["state"][name].dtype == torch.float32, name  # the master copy
            torch.testing.assert_close(r["state"][name], tensor, **tol, msg=name)


def _tied_sum(pp, key):
    """At pp=2 the GPT's tied embedding and head are copies on two ranks whose gradients
    mpar sums after the backward; the reference's autograd sums the two uses in the
    compute dtype, which mpar does too under ``grad_reduce_dtype`` low (at pp=1 both
    uses are one parameter's, summed by autograd, and the default fp32 is exact)."""
    return {"grad_reduce_dtype": key} if pp == 2 else {}


@pytest.mark.parametrize("key", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("pp", [1, 2])
def test_one_replica_one_microbatch_equals_the_reference_to_the_ulp(key, model, pp):
    config = {"pipeline_parallel_degree": pp, "microbatches": 1, key: True, **_tied_sum(pp, key)}
    results = run_distributed(train_ranks, pp, args=(config, model, "adamw", 3, 0.5), timeout=120)
    ref = mixed_reference(model, "adamw", 3, DTYPES[key], clip=0.5)
    if model == "gpt" and key == "fp16":
        assert ref["skipped"] >= 1  # the first step overflows at scale 2**16: skip covered
    # the clipping norm is summed in float64 across stages, torch's in float32:
    # the coefficient may differ by an ulp, so clipped runs agree to the ulp
    _check(results, ref, key, CLIPPED, EXACT[key])


@pytest.mark.parametrize("pp", [1, 2])
def test_one_replica_without_clipping_is_bit_for_bit(pp):
    config = {
        "pipeline_parallel_degree": pp,
        "microbatches": 1,
        "bf16": True,
        **_tied_sum(pp, "bf16"),
    }
    results = run_distributed(train_ranks, pp, args=(config, "gpt", "adamw", 3, None), timeout=120)
    ref = mixed_reference("gpt", "adamw", 3, torch.bfloat16, clip=None)
    _check(results, ref, "bf16", EXACT["bf16"], EXACT["bf16"])


ZERO = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 1, "offload_optimizer": "cpu"},
    {"stage": 2},
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 3},
    {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
]


def _id(zero):
    return "z{stage}".format(**zero) + "".join(
        f"-{k.split('_')[1]}" for k, v in zero.items() if k != "stage" and v == "cpu"
    )


GRID = [(key, pp, dp, zero) for key in DTYPES for pp, dp in [(1, 2), (2, 2)] for zero in ZERO]
DEFAULT = {
    ("bf16", 2, 2, z)
    for z in range(len(ZERO))  # every ZeRO setting, tied head across ranks
} | {("bf16", 1, 2, 0), ("bf16", 1, 2, 5), ("fp16", 1, 2, 3), ("fp16", 2, 2, 0)}
DEFAULT |= {("fp16", 2, 2, 4), ("fp16", 2, 2, 6)}


def _cases():
    for key, pp, dp, zero in GRID:
        marks = () if (key, pp, dp, ZERO.index(zero)) in DEFAULT else (pytest.mark.slow,)
        yield pytest.param(key, pp, dp, zero, marks=marks, id=f"{key}-pp{pp}-dp{dp}-{_id(zero)}")


@pytest.mark.parametrize(("key", "pp", "dp", "zero"), list(_cases()))
def test_mixed_precision_with_zero_and_data_parallelism(key, pp, dp, zero):
    """The default suite runs 13 of the 28 cases; ``pytest -m slow`` runs the others."""
    model = "gpt" if pp == 2 else "mlp"  # gpt at pp=2: its tied head sits on another rank
    config = {"pipeline_parallel_degree": pp, "microbatches": 2, key: True, "zero": zero}
    results = run_distributed(
        train_ranks, pp * dp, args=(config, model, "sgd", 3, 0.5), timeout=180
    )
    ref = mixed_reference(model, "sgd", 3, DTYPES[key], clip=0.5, split=(dp, 2))
    _check(results, ref, key, SUMMED[key], LOSS_TOL[key])


def test_four_replicas_bf16_zero3():
    config = {"microbatches": 2, "bf16": True, "zero": {"stage": 3}}
    results = run_distributed(train_ranks, 4, args=(config, "mlp", "sgd", 3, 0.5), timeout=180)
    ref = mixed_reference("mlp", "sgd", 3, torch.bfloat16, clip=0.5)
    _check(results, ref, "bf16", SUMMED["bf16"], LOSS_TOL["bf16"])
    fp32 = reference("mlp", "sgd", 3, clip=0.5)
    # ... and it really trained in bf16: the fp32 run is measurably elsewhere.
    drift = max((fp32["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert drift > 1e-4


def _max_error(state, ref):
    return max((state[k] - v).abs().max().item() for k, v in ref["state"].items())


def test_fp32_gradient_reduction_is_closer_to_fp32_accumulation_than_bf16():
    """bf16 at pp2 x dp2, ZeRO-2: with the default ``grad_reduce_dtype`` the run equals
    one process summing its four microbatches' bf16 gradients in fp32 (to bf16's
    rounding), and is closer to it than the same run reducing in bf16 (measured on
    the tied GPT, 3 SGD steps: 3.4e-5 against 1.2e-4 at most)."""
    ref = mixed_reference("gpt", "sgd", 3, torch.bfloat16, clip=0.5, split=(2, 2))
    errors = {}
    for reduce_dtype in ("fp32", "bf16"):
        config = {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "bf16": True,
            "zero": {"stage": 2},
            "grad_reduce_dtype": reduce_dtype,
        }
        results = run_distributed(train_ranks, 4, args=(config, "gpt", "sgd", 3, 0.5), timeout=180)
        errors[reduce_dtype] = max(_max_error(r["state"], ref) for r in results)
        if reduce_dtype == "fp32":
            _check(results, ref, "bf16", SUMMED["bf16"], LOSS_TOL["bf16"])
    assert errors["fp32"] < errors["bf16"] / 2, errors


def _memory(key, zero_stage, reduce_dtype):
    import mpar

    config = {
        "microbatches": 2,
        key: True,
        "zero": {"stage": zero_stage},
        "grad_reduce_dtype": reduce_dtype,
    }
    model, opt, train = start_training(config, lambda ps: torch.optim.AdamW(ps, lr=1e-3))

    x, y = batch("mlp", 0, BATCH // mpar.dp_size())
    train(model, x, y)
    opt.step()
    dtypes = {p.dtype for p in model.parameters()}
    report = mpar.memory_report()["cpu"]
    psi = sum(p.numel() for p in mlp().parameters())
    return report, psi, mpar.dp_size(), dtypes


@pytest.mark.parametrize(
    ("zero_stage", "reduce_dtype"),
    [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")],
)
def test_memory_report_follows_the_mixed_precision_formulas(zero_stage, reduce_dtype):
    """ZeRO paper, mixed precision with Adam: 2 bytes parameter, 2 gradient, 12 optimizer
    (fp32 master + two moments) per parameter, sharded by stage over N replicas; the
    gradients take 4 bytes under the default fp32 ``grad_reduce_dtype``."""
    results = run_distributed(_memory, 2, args=("bf16", zero_stage, reduce_dtype), timeout=120)
    g = 4 if reduce_dtype == "fp32" else 2
    for report, psi, n, dtypes in results:
        assert dtypes == {torch.bfloat16}
        pad = 12 * n * 2  # < n elements of padding per buffer (2 buffers), worst case fp32 x3
        step_counter = 4 * 8  # AdamW keeps a 4-byte step tensor per flat parameter (8 here)
        expected = {
            0: (2 * psi, g * psi, 12 * psi),
            1: (2 * psi, g * psi / n, 12 * psi / n),  # full gradients only until reduced
            2: (2 * psi, g * psi / n, 12 * psi / n),
            3: (2 * psi / n, g * psi / n, 12 * psi / n),
        }[zero_stage]
        got = (report["parameters"], report["gradients"], report["optimizer"])
        for value, want in zip(got, expected):
            assert want <= value <= want + pad + step_counter, (zero_stage, got, expected)


def _overflow(config):
    import mpar

    model, opt, train = start_training(config, lambda ps: make_optimizer("sgd", ps))

    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    x, y = batch("mlp", 0)
    before = model.state_dict()
    bad = x.clone()
    bad[0, 0] = 1e30  # inf once cast to fp16 on replica 0 only
    train(model, bad[shard], y[shard])
    norm = opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    after_skip = model.state_dict()
    scale_after_skip = opt.loss_scale
    train(model, x[shard], y[shard])
    opt.step()
    return {
        "unchanged": all(torch.equal(before[k], after_skip[k]) for k in before),
        "changed_later": any(not torch.equal(before[k], v) for k, v in model.state_dict().items()),
        "scales": (scale_after_skip, opt.loss_scale),
        "norm_finite": bool(torch.isfinite(norm)),
        "skipped": opt.state_dict()["loss_scaler"]["skipped_steps"],
    }


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale():
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "fp16": True, "zero": {"stage": 2}}
    for r in run_distributed(_overflow, 4, args=(config,), timeout=120):
        assert r["unchanged"] and r["changed_later"]
        assert r["scales"] == (2.0**15, 2.0**15)
        assert not r["norm_finite"]
        assert r["skipped"] == 1


def _checkpoint(config, path, save):
    import mpar

    model, opt, train = start_training(config, lambda ps: make_optimizer("adamw", ps))

    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    if not save:
        mpar.load_checkpoint(path, model, opt)
    for s in range(2) if save else range(1, 2):
        x, y = batch("mlp", s)
        train(model, x[shard], y[shard])
        opt.step()
        opt.zero_grad()
        if save and s == 0:
            mpar.save_checkpoint(path, model, opt)
            saved = model.state_dict()
    return {"state": model.state_dict(), "saved": saved if save else None}


def test_checkpoint_keeps_master_precision_across_layouts(tmp_path):
    """Saved under bf16 ZeRO-1 dp=2, resumed under bf16 ZeRO-3 pp=2 x dp=2: the fp32
    master values survive the round trip exactly (not rounded through bf16), so the
    resumed run's second step equals the uninterrupted run's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "mixed")
    first = {"microbatches": 2, "bf16": True, "zero": {"stage": 1}}
    second = {"pipeline_parallel_degree": 2, "microbatches": 2, "bf16": True, "zero": {"stage": 3}}
    straight = run_distributed(_checkpoint, 2, args=(first, path, True), timeout=120)[0]
    dcp_to_torch_save(tmp_path / "mixed" / "ckpt-000001", tmp_path / "mixed.pt")
    saved = torch.load(tmp_path / "mixed.pt", weights_only=True)["model"]
    for k, v in straight["saved"].items():
        assert torch.equal(saved[k], v), k
        assert v.dtype == torch.float32
        assert not torch.equal(v, v.to(torch.bfloat16).float()), f"{k} was rounded to bf16"
    resumed = run_distributed(_checkpoint, 4, args=(second, path, False), timeout=120)
    for r in resumed:
        for k, v in straight["state"].items():
            torch.testing.assert_close(r["state"][k], v, **SUMMED["bf16"], msg=k)
