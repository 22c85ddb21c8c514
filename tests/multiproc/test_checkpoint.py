"""Checkpoints: per-rank DCP shards, resharded on load, atomic, asynchronous.

The oracle is the uninterrupted run: layout A trains ``SAVE_AT`` steps, saves,
and goes on for ``MORE`` steps; layout B loads the checkpoint and trains the
same ``MORE`` steps. Every layout here splits each global batch into two
microbatches of the same samples (dp x microbatches = 2), so the arithmetic of
a step is the same in all of them and the resumed losses and parameters must
equal the uninterrupted ones bit for bit (fp32). A second check compares with
plain PyTorch on the whole batch (to float tolerance).
"""

from __future__ import annotations

import io
import os
import signal

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import BATCH, batch, loss_fn, make_optimizer, mlp

SAVE_AT, MORE = 2, 2

ZERO3_PP2_DP2 = {"pipeline_parallel_degree": 2, "microbatches": 1, "zero": {"stage": 3}}
ZERO1_PP1_DP2 = {"microbatches": 1, "zero": {"stage": 1}}
PP2_DP1 = {"pipeline_parallel_degree": 2, "microbatches": 2}
PP2_V2_DP1 = {"pipeline_parallel_degree": 2, "virtual_stages": 2, "microbatches": 2}


ZERO2_DP2 = {"zero": {"stage": 2}, "microbatches": 1}
ZERO3_DP2 = {"zero": {"stage": 3}, "microbatches": 1}


def _start(config, *, eager=False):
    """Rank body set-up: ``mpar.init(config)``, the MLP (partitioned now if ``eager``),
    AdamW, and a ``@mpar.step`` training function."""
    import mpar

    mpar.init(config)
    microbatch = batch("mlp", 0)[0][: BATCH // mpar.dp_size() // mpar.config().microbatches]
    model = mpar.DistributedModel(mlp(), example_inputs=microbatch if eager else None)
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    return model, opt, train


def _steps(model, opt, train, steps, after=None):
    """Train on global batches ``steps`` (this replica's share of each); calls
    ``after(s)`` after step ``s``; returns the losses."""
    import mpar

    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    losses = []
    for s in steps:
        x, y = batch("mlp", s)
        shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        losses.append(train(model, x[shard], y[shard]).reduce_mean())
        opt.step()
        opt.zero_grad()
        if after is not None:
            after(s)
    return torch.stack(losses)


def _train(config, root, start, steps, *, load=False, save_at=None, async_save=False, eager=False):
    """Rank body: (load,) train ``steps`` steps from ``start`` (saving after step
    ``save_at``); returns user_content, losses, the gathered model state and the
    gathered optimizer state."""
    import mpar

    model, opt, train = _start(config, eager=eager)
    user = mpar.load_checkpoint(root, model, opt) if load else None
    handles = []

    def save(s):
        if s + 1 == save_at:
            user_content = {"step": s + 1}
            handles.append(
                mpar.save_checkpoint(root, model, opt, user_content, async_save=async_save)
            )

    losses = _steps(model, opt, train, range(start, start + steps), save)
    for handle in handles:
        handle.wait()
    return user, losses, model.state_dict(), opt.state_dict()["state"]


def _body_saving(config, root, async_save):
    return _train(config, root, 0, SAVE_AT + MORE, save_at=SAVE_AT, async_save=async_save)


def _body_resuming(config, root, eager):
    return _train(config, root, SAVE_AT, MORE, load=True, eager=eager)


def _reference(steps):
    net = mlp()
    opt = make_optimizer("adamw", net.parameters())
    losses = []
    for s in range(steps):
        x, y = batch("mlp", s)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), net.state_dict()


def _save_run(config, world, root, async_save=False):
    """Layout A: the uninterrupted run, which saves after SAVE_AT steps."""
    (_, losses, state, _), *_ = run_distributed(
        _body_saving, world, args=(config, str(root), async_save), timeout=180
    )
    return losses, state


def _check_resumed(config, world, root, losses, state, eager=False):
    """Layout B resumes from the checkpoint: the same losses and parameters, exactly."""
    tol = {"rtol": 0, "atol": 0}
    for user, got_losses, got_state, _ in run_distributed(
        _body_resuming, world, args=(config, str(root), eager), timeout=180
    ):
        assert user == {"step": SAVE_AT}
        torch.testing.assert_close(got_losses, losses[SAVE_AT:], **tol)
        for name, tensor in state.items():
            torch.testing.assert_close(got_state[name], tensor, **tol, msg=name)


def test_zero3_pp2_dp2_resumes_exactly_in_other_layouts(tmp_path):
    losses, state = _save_run(ZERO3_PP2_DP2, 4, tmp_path)
    ref_losses, ref_state = _reference(SAVE_AT + MORE)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, tensor in ref_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000001"
    files = sorted(p.name for p in (tmp_path / "ckpt-000001").iterdir())
    assert ".metadata" in files and "mpar-complete.json" in files
    assert {f.split("_")[2] for f in files if f.endswith(".distcp")} == {"0", "1", "2", "3"}
    _check_resumed(ZERO1_PP1_DP2, 2, tmp_path, losses, state, eager=True)
    _check_resumed(PP2_DP1, 2, tmp_path, losses, state)
    _check_resumed(PP2_V2_DP1, 2, tmp_path, losses, state)


def test_offloaded_zero3_resumes_exactly_without_offload(tmp_path):
    saved = {**ZERO3_PP2_DP2, "zero": {"stage": 3, "offload_optimizer": "cpu"}}
    losses, state = _save_run(saved, 4, tmp_path)
    _check_resumed(PP2_DP1, 2, tmp_path, losses, state)


def test_bf16_zero3_resumes_exactly_in_another_bf16_layout(tmp_path):
    losses, state = _save_run({**ZERO3_PP2_DP2, "bf16": True}, 4, tmp_path)
    _check_resumed({**ZERO1_PP1_DP2, "bf16": True}, 2, tmp_path, losses, state, eager=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved",
    [
        {**ZERO3_PP2_DP2, "zero": {"stage": 3, "offload_optimizer": "cpu"}},
        {**ZERO3_PP2_DP2, "zero": {"stage": 3, "offload_params": "cpu"}},
        {**ZERO3_PP2_DP2, "zero": {"stage": 2}},
        {"pipeline_parallel_degree": 2, "microbatches": 1},
    ],
)
def test_resume_grid(tmp_path, saved):
    losses, state = _save_run(saved, 4, tmp_path)
    _check_resumed(ZERO1_PP1_DP2, 2, tmp_path, losses, state)
    _check_resumed({**ZERO1_PP1_DP2, "zero": {"stage": 3}}, 2, tmp_path, losses, state)
    _check_resumed(PP2_DP1, 2, tmp_path, losses, state, eager=True)
    _check_resumed(PP2_V2_DP1, 2, tmp_path, losses, state)
    _check_resumed({**PP2_V2_DP1, "zero": {"stage": 1}}, 2, tmp_path, losses, state)
    offloaded = {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}
    _check_resumed({**ZERO1_PP1_DP2, "zero": offloaded}, 2, tmp_path, losses, state)


def test_zero3_resumes_exactly_at_pp4_with_virtual_stages(tmp_path):
    # two microbatches keep every layout's arithmetic equal; the interleaved schedule
    # would need a multiple of 4, the simple one (GPipe) takes 2
    pp4_v2 = {**PP2_V2_DP1, "pipeline_parallel_degree": 4, "pipeline": "simple"}
    losses, state = _save_run(ZERO3_PP2_DP2, 4, tmp_path)
    _check_resumed(pp4_v2, 4, tmp_path, losses, state)
    _check_resumed({**pp4_v2, "zero": {"stage": 3}}, 4, tmp_path, losses, state)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_resume_grid(tmp_path, dtype):
    losses, state = _save_run({**ZERO3_PP2_DP2, dtype: True}, 4, tmp_path)
    _check_resumed({**PP2_DP1, dtype: True}, 2, tmp_path, losses, state)
    _check_resumed({**PP2_V2_DP1, dtype: True}, 2, tmp_path, losses, state)


# --------------------------------------------------------------------- async
def _body_async(config, root):
    """Saves asynchronously with the shard writes held back until two more steps
    have run: the step loop does not wait for the files."""
    import threading

    import mpar
    from mpar.checkpoint import _dcp

    release = threading.Event()
    write = _dcp.BoundedWriter.write_data

    def held_write(self, plan, planner):
        if not release.wait(120):
            raise TimeoutError("the test never released the write")
        return write(self, plan, planner)

    _dcp.BoundedWriter.write_data = held_write
    model, opt, train = _start(config)
    handles, writing = [], []

    def save_or_watch(s):
        if handles:
            writing.append(not handles[0].done())
        if s + 1 == SAVE_AT:
            handles.append(mpar.save_checkpoint(root, model, opt, {"step": s + 1}, async_save=True))

    losses = _steps(model, opt, train, range(SAVE_AT + MORE), save_or_watch)
    release.set()
    final = mpar.wait_checkpoint()
    return writing, handles[0].done(), str(final), losses, model.state_dict()


def test_async_save_overlaps_training_and_resumes_exactly(tmp_path):
    results = run_distributed(_body_async, 4, args=(ZERO3_PP2_DP2, str(tmp_path)), timeout=180)
    writing, done, final, losses, state = results[0]
    assert writing == [True] * MORE  # the steps after the save ran while it was writing
    assert done and final == str(tmp_path / "ckpt-000001")
    sync_losses, _ = _reference(SAVE_AT + MORE)
    torch.testing.assert_close(losses, sync_losses, rtol=1e-5, atol=1e-6)
    # the checkpoint holds the state of step SAVE_AT, not the one the loop reached
    _check_resumed(PP2_DP1, 2, tmp_path, losses, state)


# -------------------------------------------------------------------- crashes


def _body_crash(root, victim, where):
    """Save after step 1; during the save after step 2, rank ``victim`` dies
    (SIGKILL) after writing its shards (``"write"``) or just before the commit
    (``"commit"``, rank 0: every shard and DCP's .metadata are on disk)."""
    import mpar
    from mpar.checkpoint import _dcp, _dirs

    model, opt, train = _start(ZERO2_DP2)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def write_then_die(self, plan, planner, write=_dcp.BoundedWriter.write_data):
        write(self, plan, planner).wait()
        die()

    def save(s):
        if s == 1 and mpar.rank() == victim:
            if where == "write":
                _dcp.BoundedWriter.write_data = write_then_die
            else:
                _dirs.commit = die
        mpar.save_checkpoint(root, model, opt, user_content={"step": s + 1})

    _steps(model, opt, train, range(2), save)


def _body_state(root, steps, load, save=False):
    """Train ``steps`` steps (or load ``root``; then save to it); the gathered model
    and optimizer state."""
    import mpar

    model, opt, train = _start(ZERO2_DP2, eager=True)
    user = mpar.load_checkpoint(root, model, opt) if load else None
    if steps:
        _steps(model, opt, train, range(steps))
    if save:
        mpar.save_checkpoint(root, model, opt, user_content=7)
    return user, model.state_dict(), opt.state_dict()["state"]


def _assert_same_state(a, b):
    for name, tensor in a[0].items():
        torch.testing.assert_close(b[0][name], tensor, rtol=0, atol=0, msg=name)
    assert sorted(a[1]) == sorted(b[1])
    for index, entry in a[1].items():
        for key, value in entry.items():
            torch.testing.assert_close(b[1][index][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(("victim", "where"), [(1, "write"), (0, "commit")])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, victim, where):
    root = str(tmp_path)
    # the survivor hears of it (no hang): a lost connection, or the victim's death
    lost = f"rank {victim} died|previous checkpoint stays the latest|lost contact with rank 0"
    with pytest.raises(DistributedTestError, match=lost):
        run_distributed(_body_crash, 2, args=(root, victim, where), timeout=120)
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000001"
    # a survivor that learnt of the failure removed the partial directory, else it is left
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-ckpt-000002")]
    assert all(not (p / "mpar-complete.json").exists() for p in partial)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-000001"]
    ((user, *loaded), _) = run_distributed(_body_state, 2, args=(root, 0, True), timeout=120)
    ((_, *expected), _) = run_distributed(_body_state, 2, args=(root, 1, False), timeout=120)
    assert user == {"step": 1}
    _assert_same_state(expected, loaded)
    if where == "commit":  # rank 0 died before the commit: shards and .metadata are there
        assert (partial[0] / ".metadata").exists()
        with pytest.raises(DistributedTestError, match="no completion marker"):
            run_distributed(_load_missing, 1, args=(str(partial[0]),), timeout=60)


def _body_save_again(root):
    import mpar

    mpar.init()
    model = mpar.DistributedModel(mlp())
    return str(mpar.save_checkpoint(root, model, user_content="again").wait())


def test_the_next_save_clears_an_interrupted_one(tmp_path):
    (tmp_path / "ckpt-000001").mkdir()
    (tmp_path / ".tmp-ckpt-000002-dead").mkdir()
    (final,) = run_distributed(_body_save_again, 1, args=(str(tmp_path),), timeout=60)
    assert final == str(tmp_path / "ckpt-000002")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".mpar-save.lock", "ckpt-000001", "ckpt-000002", "latest"]


# ------------------------------------------------------------ other formats
def test_single_file_checkpoint_of_the_earlier_format_still_loads(tmp_path):
    net = mlp()
    opt = make_optimizer("adamw", net.parameters())
    for s in range(SAVE_AT):
        x, y = batch("mlp", s)
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path / "old.pt"
    payload = {"model": net.state_dict(), "optimizer": opt.state_dict(), "config": {}}
    torch.save({"format": "mpar-gathered-v1", **payload, "user_content": {"step": 2}}, path)
    ref_losses, ref_state = _reference(SAVE_AT + MORE)
    for user, losses, state, _ in run_distributed(
        _body_resuming, 2, args=(PP2_DP1, str(path), False), timeout=120
    ):
        assert user == {"step": SAVE_AT}
        torch.testing.assert_close(losses, ref_losses[SAVE_AT:], rtol=1e-5, atol=1e-6)
        for name, tensor in ref_state.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # converted by loading it and saving again (before any step), it resumes the same
    run_distributed(_convert, 2, args=(str(path), str(tmp_path / "ckpt")), timeout=120)
    for user, got_losses, got_state, _ in run_distributed(
        _body_resuming, 2, args=(PP2_DP1, str(tmp_path / "ckpt"), False), timeout=120
    ):
        assert user == {"step": SAVE_AT}
        torch.testing.assert_close(got_losses, losses, rtol=0, atol=0)
        for name, tensor in state.items():
            torch.testing.assert_close(got_state[name], tensor, rtol=0, atol=0, msg=name)


def _convert(old, new):
    import mpar

    mpar.init({"zero": {"stage": 1}})
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    user = mpar.load_checkpoint(old, model, opt)
    mpar.save_checkpoint(new, model, opt, user_content=user)


def test_plain_pytorch_reads_the_checkpoint(tmp_path):
    """The recipe of docs/runtime.md: torch.distributed.checkpoint in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (_, state, opt_state), _ = run_distributed(
        _body_state_then_save, 2, args=(str(tmp_path),), timeout=120
    )
    net = mlp()
    model_state = net.state_dict()
    dcp.load({"model": model_state}, checkpoint_id=tmp_path / "ckpt-000001", no_dist=True)
    for name, tensor in state.items():
        torch.testing.assert_close(model_state[name], tensor, rtol=0, atol=0, msg=name)
    dcp_to_torch_save(tmp_path / "ckpt-000001", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    names = [n for n, _ in net.named_parameters()]
    for index, entry in opt_state.items():
        for key, value in entry.items():
            torch.testing.assert_close(full["optim"]["state"][names[index]][key], value)
    assert full["optim"]["param_groups"][0]["params"] == names
    assert torch.load(io.BytesIO(full["mpar"]["extras"]), weights_only=True)["user_content"] == 7


def _body_state_then_save(root):
    return _body_state(root, 2, False, save=True)


# --------------------------------------------------------------------- errors
def _load_into(root, net_factory, groups):
    import mpar

    mpar.init(ZERO2_DP2)
    model = mpar.DistributedModel(net_factory(), example_inputs=batch("mlp", 0)[0][:6])
    params = list(model.parameters())
    opt_groups = [{"params": params[:2]}, {"params": params[2:]}] if groups == 2 else params
    opt = mpar.DistributedOptimizer(torch.optim.AdamW(opt_groups, lr=0.01))
    mpar.load_checkpoint(root, model, opt)
    return None


def _wider_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))


def _load_model_only(root):
    import mpar

    mpar.init(ZERO3_DP2)
    model = mpar.DistributedModel(mlp())
    user = mpar.load_checkpoint(root, model)
    return user, model.state_dict()


def test_loading_into_another_model_or_optimizer_is_a_clear_error_on_every_rank(tmp_path):
    ((_, state, _), _) = run_distributed(
        _body_state_then_save, 2, args=(str(tmp_path),), timeout=120
    )
    for user, loaded in run_distributed(_load_model_only, 2, args=(str(tmp_path),), timeout=60):
        assert user == 7  # the model alone loads from a checkpoint that has more
        for name, tensor in state.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    with pytest.raises(DistributedTestError, match="CheckpointError.*saved from another model"):
        run_distributed(_load_into, 2, args=(str(tmp_path), _wider_mlp, 1), timeout=60)
    with pytest.raises(DistributedTestError, match="CheckpointError.*parameter group"):
        run_distributed(_load_into, 2, args=(str(tmp_path), mlp, 2), timeout=60)


def _load_missing(path):
    import mpar

    mpar.init()
    mpar.load_checkpoint(path, mpar.DistributedModel(mlp()))


def test_missing_or_incomplete_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(DistributedTestError, match="does not exist"):
        run_distributed(_load_missing, 1, args=(str(tmp_path / "nope"),), timeout=60)
    with pytest.raises(DistributedTestError, match="holds no complete checkpoint"):
        run_distributed(_load_missing, 1, args=(str(tmp_path),), timeout=60)
    (tmp_path / "ckpt-000001").mkdir()
    (tmp_path / "ckpt-000001" / ".metadata").write_bytes(b"")
    with pytest.raises(DistributedTestError, match="no completion marker"):
        run_distributed(_load_missing, 1, args=(str(tmp_path / "ckpt-000001"),), timeout=60)


# ------------------------------------------------- tied embeddings, GPT-2
def _body_gpt(kind, config, root, start, steps, load):
    """A GPT whose embedding is tied to its LM head (on another rank at pp 2):
    mpar's TinyGPT (``kind="tiny"``) or Hugging Face's GPT-2 (``"hf"``)."""
    import mpar
    from tests.multiproc._pipeline_cases import hf_gpt2, tiny_gpt

    mpar.init(config)
    model = mpar.DistributedModel(hf_gpt2() if kind == "hf" else tiny_gpt())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    user = mpar.load_checkpoint(root, model, opt) if load else None

    @mpar.step
    def train(m, x, y):
        out = m(input_ids=x).logits if kind == "hf" else m(x)
        loss = loss_fn(out, y)
        m.backward(loss)
        return loss

    losses = []
    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    for s in range(start, start + steps):
        x, y = batch("gpt", s)
        shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        losses.append(train(model, x[shard], y[shard]).reduce_mean())
        opt.step()
        opt.zero_grad()
        if s + 1 == SAVE_AT and not load:
            mpar.save_checkpoint(root, model, opt, user_content={"step": s + 1})
            saved = model.state_dict()
    return user, torch.stack(losses), model.state_dict(), None if load else saved


def _gpt_resumes_exactly(kind, root):
    """Saved at ZeRO-3 pp 2 x dp 2, resumed at pp 2 x dp 1: the same losses and state.
    (pp 2 x dp 1 sums the tied copies' gradients in the same order; with pp 1
    autograd sums them in another order: ulps apart.)"""
    ((_, losses, state, saved), *_) = run_distributed(
        _body_gpt, 4, args=(kind, ZERO3_PP2_DP2, root, 0, SAVE_AT + MORE, False), timeout=240
    )
    for user, got_losses, got_state, _ in run_distributed(
        _body_gpt, 2, args=(kind, PP2_DP1, root, SAVE_AT, MORE, True), timeout=240
    ):
        assert user == {"step": SAVE_AT}
        torch.testing.assert_close(got_losses, losses[SAVE_AT:], rtol=0, atol=0)
        for name, tensor in state.items():
            torch.testing.assert_close(got_state[name], tensor, rtol=0, atol=0, msg=name)
    return saved


def test_tied_embedding_across_pipeline_ranks_resumes_exactly(tmp_path):
    _gpt_resumes_exactly("tiny", str(tmp_path))


@pytest.mark.slow
def test_hf_gpt2_with_tied_weights_resumes_exactly_and_exports_to_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch.distributed.checkpoint import load as dcp_load

    from tests.multiproc._pipeline_cases import hf_gpt2

    saved = _gpt_resumes_exactly("hf", str(tmp_path / "ckpt"))
    # docs/runtime.md's export recipe
    hf = hf_gpt2()
    hf_state = hf.state_dict()
    dcp_load({"model": hf_state}, checkpoint_id=tmp_path / "ckpt" / "ckpt-000001", no_dist=True)
    hf.load_state_dict(hf_state)
    hf.save_pretrained(tmp_path / "export", safe_serialization=True)
    assert (tmp_path / "export" / "model.safetensors").is_file()
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


class _Opaque:
    pass


def _save_opaque(root):
    import mpar

    mpar.init()
    mpar.save_checkpoint(root, mpar.DistributedModel(mlp()), user_content={"x": _Opaque()})


def test_user_content_that_could_not_be_loaded_back_is_refused_at_save(tmp_path):
    with pytest.raises(DistributedTestError, match="user_content must load with.*weights_only"):
        run_distributed(_save_opaque, 1, args=(str(tmp_path),), timeout=60)
    assert not (tmp_path / "latest").exists()


def _load_with_optimizer(root):
    import mpar

    mpar.init()
    model = mpar.DistributedModel(mlp())
    mpar.save_checkpoint(root, model)
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    mpar.load_checkpoint(root, model, opt)


def test_a_checkpoint_without_optimizer_state_says_so_at_load(tmp_path):
    with pytest.raises(DistributedTestError, match="holds no optimizer state.*optimizer=None"):
        run_distributed(_load_with_optimizer, 1, args=(str(tmp_path),), timeout=60)


def _async_then_exit(root):
    import mpar

    mpar.init(ZERO2_DP2)
    model = mpar.DistributedModel(mlp())
    handle = mpar.save_checkpoint(root, model, user_content="last", async_save=True)
    return repr(handle)  # the harness calls mpar.shutdown(), which waits for the save


def test_shutdown_waits_for_an_asynchronous_save(tmp_path):
    run_distributed(_async_then_exit, 2, args=(str(tmp_path),), timeout=60)
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000001"
    assert (tmp_path / "ckpt-000001" / "mpar-complete.json").is_file()


def _load_state(config, root):
    """Load ``root`` before partitioning, partition with a forward-only step (the
    optimizer state is read at ``state_dict``); the gathered model and optimizer state."""
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    mpar.load_checkpoint(root, model, opt)

    @mpar.step
    def evaluate(m, x):
        return m(x)

    evaluate(model, batch("mlp", 0)[0][: 2 * mpar.config().microbatches])
    return model.state_dict(), opt.state_dict()["state"]


@pytest.mark.parametrize(
    ("config", "world"),
    [
        ({"zero": {"stage": 3}}, 3),  # shards of 3 ranks: padding and cuts anywhere
        ({"pipeline_parallel_degree": 2, "zero": {"stage": 3, "offload_params": "cpu"}}, 4),
    ],
)
def test_loading_reshards_every_value_exactly(tmp_path, config, world):
    ((_, state, opt_state), _) = run_distributed(
        _body_state_then_save, 2, args=(str(tmp_path),), timeout=120
    )
    for loaded in run_distributed(_load_state, world, args=(config, str(tmp_path)), timeout=120):
        _assert_same_state((state, opt_state), loaded)


def _save_without_gathering(root):
    """ZeRO-3 dp 2: a save during which any gather of parameters or optimizer state
    (the all-gather under every unshard and full-state path) raises."""
    import mpar
    from mpar.shard import _bucket, _state_dict

    model, opt, train = _start(ZERO3_DP2)
    _steps(model, opt, train, range(1))

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint save gathered a flat buffer")

    gathers = (_bucket.all_gather_flat, _state_dict.all_gather_flat)
    _bucket.all_gather_flat = _state_dict.all_gather_flat = refuse
    try:
        mpar.save_checkpoint(root, model, opt, user_content="sharded")
    finally:
        _bucket.all_gather_flat, _state_dict.all_gather_flat = gathers
    return model.state_dict(), opt.state_dict()["state"]


def test_a_zero3_save_gathers_nothing(tmp_path):
    ((state, opt_state), _) = run_distributed(
        _save_without_gathering, 2, args=(str(tmp_path),), timeout=120
    )
    for loaded in run_distributed(_load_state, 2, args=(ZERO3_DP2, str(tmp_path)), timeout=120):
        _assert_same_state((state, opt_state), loaded)


def _interleaved_groups(root, load):
    """ZeRO-2 dp 2, AdamW with weights and biases in two parameter groups (their
    optimizer segments alternate within each bucket): train SAVE_AT + MORE steps saving
    after SAVE_AT, or load and train the last MORE; the losses and optimizer state."""
    import mpar

    mpar.init(ZERO2_DP2)
    model = mpar.DistributedModel(mlp())
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.02, "weight_decay": 0},
    ]
    opt = mpar.DistributedOptimizer(torch.optim.AdamW(groups, lr=0.01))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    if load:
        mpar.load_checkpoint(root, model, opt)
        steps = range(SAVE_AT, SAVE_AT + MORE)
    else:
        steps = range(SAVE_AT + MORE)

    def save(s):
        if s + 1 == SAVE_AT and not load:
            mpar.save_checkpoint(root, model, opt)

    losses = _steps(model, opt, train, steps, save)[-MORE:]
    return losses, opt.state_dict()["state"]


def test_parameter_groups_interleaved_in_a_bucket_resume_exactly(tmp_path):
    (losses, state), _ = run_distributed(_interleaved_groups, 2, args=(str(tmp_path), False))
    for resumed, resumed_state in run_distributed(
        _interleaved_groups, 2, args=(str(tmp_path), True)
    ):
        torch.testing.assert_close(resumed, losses, rtol=0, atol=0)
        for index, values in state.items():
            for key, value in values.items():
                torch.testing.assert_close(resumed_state[index][key], value, rtol=0, atol=0)
