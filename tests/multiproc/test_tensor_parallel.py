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

from mpar.testing import DistributedTestError, run_distributed
from mpar.testing.models import GPT_TP_PLAN
from tests.multiproc._pipeline_cases import MODELS, reference, train_ranks

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


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("tp", "optimizer"),
    [
        (2, "sgd"),
        (4, "adamw"),
        pytest.param(2, "adamw", marks=SLOW),
        pytest.param(4, "sgd", marks=SLOW),
    ],
)
def test_tp_alone(tp, optimizer):
    results = run_distributed(
        train_ranks, tp, args=(_config(tp), "tp_gpt", optimizer, STEPS), timeout=240
    )
    _check(results, reference("tp_gpt", optimizer, STEPS))
    shards = results[0]["tp_shards"]
    assert "blocks.0.q.weight" in shards and "blocks.0.ln_1.weight" not in shards
    # Memory: each rank holds 1/tp of every split parameter and all of the replicated ones.
    params = dict(MODELS["tp_gpt"]().named_parameters())
    split = sum(params[n].numel() for n in shards)
    replicated = sum(p.numel() for n, p in params.items() if n not in shards)
    for r in results:
        want = 4 * (split // tp + replicated)
        assert r["param_bytes"] == r["report_param_bytes"] == want  # counted
        assert r["param_storage_bytes"] == want  # measured: the storage allocated


@pytest.mark.parametrize(
    ("placement", "coordinates"),
    [
        ("cluster", [(0, 0), (0, 1), (1, 0), (1, 1)]),  # TP innermost: ranks 0, 1 split
        ("TPD", [(0, 0), (1, 0), (0, 1), (1, 1)]),  # TP outermost: ranks 0, 2 split
    ],
)
def test_pp2_tp2(placement, coordinates):
    config = _config(2, pipeline_parallel_degree=2, microbatches=4, placement_strategy=placement)
    results = run_distributed(train_ranks, 4, args=(config, "tp_gpt", "sgd", STEPS), timeout=240)
    # (pp_rank, tp_rank) of global ranks 0..3
    assert [(r["pp"][0], r["tp"][0]) for r in results] == coordinates
    assert {r["tp"][1] for r in results} == {2}
    _check(results, reference("tp_gpt", "sgd", STEPS))


def test_pp2_tp2_under_nccl_rules():
    """Transfers through the transport that enforces NCCL's rules (``nccl_rules``)."""
    config = _config(2, pipeline_parallel_degree=2, microbatches=4, nccl_rules=True)
    results = run_distributed(train_ranks, 4, args=(config, "tp_gpt", "sgd", STEPS), timeout=240)
    _check(results, reference("tp_gpt", "sgd", STEPS))


@pytest.mark.slow
def test_pp2_tp2_auto_keys():
    """ "auto" keys under TP: the planner keeps the configured degree and lays out one TP
    rank's share (``mpar.tensor_parallel.measure_tp_splits``); the resolved run is the
    one-process model."""
    config = _config(
        2,
        pipeline_parallel_degree=2,
        microbatches="auto",
        zero={"stage": "auto"},
        device_memory="256MiB",
    )
    results = run_distributed(train_ranks, 4, args=(config, "tp_gpt", "sgd", STEPS), timeout=300)
    resolved = {(r["config"].microbatches, r["config"].zero.stage) for r in results}
    assert len(resolved) == 1 and all(r["config"].auto_keys == () for r in results)
    _check(results, reference("tp_gpt", "sgd", STEPS))


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("sgd", marks=SLOW)])
def test_tp2_clip_global_norm(optimizer):
    """clip_grad_norm_ sees the one-process norm: split parameters' pieces summed over
    TP, replicated ones counted once (a small max_norm makes every step clip)."""
    results = run_distributed(
        train_ranks, 2, args=(_config(2), "tp_gpt", optimizer, STEPS, 0.05), timeout=240
    )
    _check(results, reference("tp_gpt", optimizer, STEPS, clip=0.05))


@pytest.mark.parametrize(
    "zero",
    [
        pytest.param({"stage": 1}, marks=SLOW),
        {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    ],
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
        pytest.param({"pipeline": "interleaved", "virtual_stages": 2}, marks=SLOW),
        pytest.param({"activation_checkpointing": True}, marks=SLOW),
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


# ------------------------------------------------------------------------- resume
SAVE_AT, MORE = 2, 2


def _body_checkpoint(config, root, start, steps, load):
    """Train the TP GPT ``steps`` steps from ``start`` (loading first, or saving after
    step SAVE_AT); returns the losses and the gathered state after each step."""
    import mpar
    from tests.multiproc._pipeline_cases import MODELS, batch, loss_fn, make_optimizer

    mpar.init(config)
    model = mpar.DistributedModel(MODELS["tp_gpt"]())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    if load:
        mpar.load_checkpoint(root, model, opt)

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    losses, states = [], []
    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    for s in range(start, start + steps):
        x, y = batch("tp_gpt", s)
        n = x.shape[0] // dp
        losses.append(
            float(
                train(
                    model, x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]
                ).reduce_mean()
            )
        )
        opt.step()
        opt.zero_grad()
        states.append(model.state_dict())
        if s + 1 == SAVE_AT and not load:
            mpar.save_checkpoint(root, model, opt)
    return losses, states


@pytest.mark.parametrize(
    ("world", "tp"), [pytest.param(1, 1, marks=SLOW), (4, 4)], ids=["tp1", "tp4"]
)
def test_checkpoint_at_pp2_tp2_resumes_at_other_tp(tmp_path, world, tp):
    """Saved at pp=2 x tp=2; resumed at tp=1 (one process) and tp=4: the next steps
    equal the uninterrupted run's (to fp32 rounding: the TP sums differ in order)."""
    saving = {**_config(2, pipeline_parallel_degree=2), "microbatches": 2}
    ((losses, states), *_) = run_distributed(
        _body_checkpoint, 4, args=(saving, str(tmp_path), 0, SAVE_AT + MORE, False), timeout=300
    )
    config = {**_config(tp), "microbatches": 2}
    for got_losses, got_states in run_distributed(
        _body_checkpoint, world, args=(config, str(tmp_path), SAVE_AT, MORE, True), timeout=300
    ):
        assert_close(torch.tensor(got_losses), torch.tensor(losses[SAVE_AT:]), **TOL)
        for got, want in zip(got_states, states[SAVE_AT:]):
            for key, value in want.items():
                assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


# ------------------------------------------------------- meta build, HF weights
def _gpt2_factory():
    from tests.multiproc import _hf_cases as hf

    return hf.build("gpt2")


def _body_meta_pretrained(config, root, out):
    """A meta-built GPT-2 under TP: its initial state, then one loaded from ``root``
    (applied when partitioned) and written back to ``out`` with save_pretrained."""
    import mpar

    mpar.init(config)
    ids = torch.zeros(2, 8, dtype=torch.long)
    fresh = mpar.DistributedModel(_gpt2_factory, example_kwargs={"input_ids": ids})
    split = [p.shape for n, p in fresh.named_parameters() if n.endswith("c_attn.weight")]
    initial = fresh.state_dict()
    loaded = mpar.DistributedModel(_gpt2_factory)
    mpar.load_pretrained(loaded, root)
    loaded._partition((), {"input_ids": ids})
    mpar.save_pretrained(loaded, out, max_shard_size="40KB")
    return initial, loaded.state_dict(), split


@pytest.mark.parametrize(
    ("world", "extra"),
    [(4, {"zero": {"stage": 3}}), pytest.param(4, {"pipeline_parallel_degree": 2}, marks=SLOW)],
    ids=["tp2-dp2-zero3", "pp2-tp2"],
)
def test_meta_build_and_pretrained_weights_under_tp(tmp_path, world, extra):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    import mpar

    with torch.device("meta"):
        reference = _gpt2_factory()
    mpar.materialize(reference, seed=0)
    torch.manual_seed(3)
    weights = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    del weights["lm_head.weight"]  # tied to transformer.wte.weight
    (tmp_path / "in").mkdir()
    save_file(weights, tmp_path / "in" / "model.safetensors")
    config = {"tensor_parallel_degree": 2, "microbatches": 1, **extra}
    out = tmp_path / "out"
    results = run_distributed(
        _body_meta_pretrained, world, args=(config, str(tmp_path / "in"), str(out)), timeout=300
    )
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(file))
    assert len(list(out.glob("*.safetensors"))) > 1
    for initial, loaded, split in results:
        held = [shape for shape in split if shape.numel()]  # ZeRO-3 releases between steps
        assert held == [torch.Size([32, 48])] * len(held)  # 3 x 32 / 2 columns of c_attn
        for key, value in reference.state_dict().items():
            assert torch.equal(initial[key], value), key
        for key, value in weights.items():
            assert torch.equal(loaded[key], value), key
            assert torch.equal(written[key], value), key


# ------------------------------------------------------- vocabulary-parallel loss
VOCAB_PLAN = {**GPT_TP_PLAN, "wte": "embedding_rowwise", "head": "colwise"}
"""The tied embedding and LM head split on the vocabulary (the same rows of one weight)."""


def _body_vocab_parallel(config, steps):
    """Train the TP GPT with its logits split on the vocabulary and the loss computed on
    the pieces; returns the losses, this rank's logits and the gathered state."""
    import mpar
    from mpar.tensor_parallel import vocab_parallel_cross_entropy
    from tests.multiproc._pipeline_cases import MODELS, batch, make_optimizer

    mpar.init(config)
    model = mpar.DistributedModel(MODELS["tp_gpt"]())
    opt = mpar.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

    @mpar.step
    def train(m, x, y):
        logits = m(x)
        loss = vocab_parallel_cross_entropy(logits, y).mean()
        m.backward(loss)
        return {"loss": loss, "logits": logits}

    losses, outputs = [], []
    for s in range(steps):
        result = train(model, *batch("tp_gpt", s))
        opt.step()
        opt.zero_grad()
        losses.append(float(result["loss"].reduce_mean()))
        outputs.append(result["logits"].concat())
    shards = dict(model.tp_layout.shards)
    return {"losses": losses, "outputs": outputs, "state": model.state_dict(), "shards": shards}


@pytest.mark.parametrize(
    "extra", [{}, pytest.param({"pipeline_parallel_degree": 2}, marks=SLOW)], ids=["tp2", "pp2-tp2"]
)
def test_vocab_parallel_cross_entropy(extra):
    world = 2 * extra.get("pipeline_parallel_degree", 1)
    config = {**_config(2, **extra), "tp_plan": VOCAB_PLAN}
    results = run_distributed(_body_vocab_parallel, world, args=(config, STEPS), timeout=240)
    ref = reference("tp_gpt", "sgd", STEPS)
    assert results[0]["shards"]["wte.weight"].dim == 0  # the vocabulary rows
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for key, value in ref["state"].items():
            assert_close(r["state"][key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")
        for step, whole in enumerate(ref["outputs"]):  # a step's outputs are TP rank 0's:
            first_half = whole.chunk(2, dim=-1)[0]  # its piece of the vocabulary
            assert_close(r["outputs"][step], first_half, **TOL)


# ------------------------------------------------------------ sequence parallelism
def _sp_config(tp: int, **extra):
    return _config(tp, optimize="memory", **extra)


@pytest.mark.parametrize(
    ("pp", "optimizer"),
    [
        (2, "adamw"),
        pytest.param(1, "sgd", marks=SLOW),
        pytest.param(1, "adamw", marks=SLOW),
        pytest.param(2, "sgd", marks=SLOW),
    ],
)
def test_sequence_parallel(pp, optimizer):
    """optimize 'memory': the residual stream between the blocks' split layers is split
    along the sequence; norms' and rowwise biases' gradients are summed over TP."""
    config = _sp_config(2, pipeline_parallel_degree=pp, microbatches=2 * pp)
    results = run_distributed(
        train_ranks, 2 * pp, args=(config, "tp_gpt", optimizer, STEPS), timeout=240
    )
    assert all(r["sequence_parallel"] for r in results)
    _check(results, reference("tp_gpt", optimizer, STEPS))


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"pipeline": "zero_bubble"},
        {"pipeline": "interleaved", "virtual_stages": 2},
        {"activation_checkpointing": True},
    ],
    ids=["zero_bubble", "virtual", "checkpointing"],
)
def test_sequence_parallel_schedules(extra):
    config = _sp_config(2, pipeline_parallel_degree=2, microbatches=4, **extra)
    results = run_distributed(train_ranks, 4, args=(config, "tp_gpt", "sgd", STEPS), timeout=300)
    assert all(r["sequence_parallel"] for r in results)
    _check(results, reference("tp_gpt", "sgd", STEPS))


@pytest.mark.slow
def test_sequence_parallel_bf16():
    config = _sp_config(2, bf16=True, pipeline_parallel_degree=2, microbatches=4)
    results = run_distributed(train_ranks, 4, args=(config, "tp_gpt", "sgd", STEPS), timeout=300)
    ref = reference("tp_gpt", "sgd", STEPS)
    for r in results:  # bf16 compute, as test_tp2_bf16
        assert r["sequence_parallel"]
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)
        for key, value in ref["state"].items():
            assert_close(r["state"][key], value, rtol=5e-2, atol=5e-2)


@pytest.mark.slow
def test_sequence_parallel_tp2_dp2_zero3():
    config = _sp_config(2, zero={"stage": 3}, microbatches=2)
    results = run_distributed(
        train_ranks, 4, args=(config, "tp_gpt", "adamw", STEPS, 0.05), timeout=300
    )
    assert all(r["sequence_parallel"] for r in results)
    _check(results, reference("tp_gpt", "adamw", STEPS, clip=0.05))


def _body_boundary(configs):
    """One step of the TP GPT cut by hand after blocks.1, under each config: the float
    tensors stage 0 hands to stage 1, and the activation bytes mpar counts."""
    import mpar
    from mpar.comm._types import Transfer
    from mpar.runtime import _transfers
    from tests.multiproc._pipeline_cases import MODELS, batch, loss_fn

    sent: list[torch.Tensor] = []
    leave = _transfers.Transfers.leave

    def recording(self, label, payload):
        if label.kind is Transfer.ACTIVATIONS:
            sent.extend(t for t in payload if t.is_floating_point())
        leave(self, label, payload)

    _transfers.Transfers.leave = recording
    out = []
    for config in configs:
        mpar.init(config)
        net = MODELS["tp_gpt"]()
        with mpar.partition(1):
            net.blocks[2], net.blocks[3] = net.blocks[2], net.blocks[3]
            net.ln_f, net.head = net.ln_f, net.head
        model = mpar.DistributedModel(net)

        @mpar.step
        def train(m, x, y):
            loss = loss_fn(m(x), y)
            m.backward(loss)
            return loss

        sent.clear()
        x, y = batch("tp_gpt", 0)
        train(model, x, y)
        shapes = sorted({tuple(t.shape) for t in sent})
        report = mpar.memory_report()["cpu"]["activations"]
        out.append((mpar.pp_rank(), shapes, sum(t.nbytes for t in sent), report))
        mpar.shutdown()
    return out


def test_sequence_parallel_halves_the_stage_boundary():
    """Stage boundaries carry 1/tp of the sequence (counted on what is sent), and the
    activation bytes mpar counts (memory_report) shrink on every rank."""
    common = {**_config(2, pipeline_parallel_degree=2), "auto_partition": False}
    configs = [common, {**common, "optimize": "memory"}]
    for (pp_rank, shapes, sent, acts), (_, sp_shapes, sp_sent, sp_acts) in run_distributed(
        _body_boundary, 4, args=(configs,), timeout=240
    ):
        assert sp_acts < acts
        if pp_rank == 0:  # 2 microbatches of 6 sequences of 8 tokens, 16 features
            assert shapes == [(6, 8, 16)] and sp_shapes == [(6, 4, 16)]
            assert 2 * sp_sent == sent == 2 * 6 * 8 * 16 * 4


def _body_short_sequence(config):
    """A TP GPT step on sequences of 7 tokens (fails: ranks fail fast, by design)."""
    import mpar
    from tests.multiproc._pipeline_cases import MODELS, batch, loss_fn

    mpar.init(config)
    model = mpar.DistributedModel(MODELS["tp_gpt"]())

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    x, y = batch("tp_gpt", 0)
    train(model, x[:, :7], y[:, :7])


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=SLOW)])
def test_sequence_not_divisible_by_tp(pp):
    """Refused at the first step (when the stage graphs are captured at pp > 1), naming
    the block, the length and the degree."""
    config = _sp_config(2, pipeline_parallel_degree=pp, microbatches=2)
    with pytest.raises(
        DistributedTestError,
        match=r"SequenceParallelError: .* of the first input of blocks.0 over "
        r"tensor_parallel_degree 2, but its length 7 is not divisible by 2",
    ):
        run_distributed(_body_short_sequence, 2 * pp, args=(config,), timeout=240)


def _body_refused(plan, nh_model):
    import mpar
    from tests.unit.test_tensor_parallel_plan import _Net

    mpar.init({"tensor_parallel_degree": 2, "tp_plan": plan})
    net = _Net() if nh_model else MODELS["tp_gpt"]()
    try:
        mpar.DistributedModel(net)  # wrap time: before any step
    except mpar.errors.MparError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_a_misspelt_pattern_and_an_unknown_head_count_are_refused_at_wrap_time():
    from tests.unit.test_tensor_parallel_plan import _ATTN_PLAN

    typo = {**GPT_TP_PLAN, "blocks.*.mlp.O": "rowwise"}
    for message in run_distributed(_body_refused, 2, args=(typo, False), timeout=60):
        assert message.startswith("TPPlanError: the config's tp_plan: 1 of its 7 patterns")
    for message in run_distributed(_body_refused, 2, args=(_ATTN_PLAN, True), timeout=60):
        assert message.startswith("TPPlanError: split 2 ways, module blocks.0 (_Attention)")
