"""Checkpoints: atomic, gathered, and reloadable into a different layout."""

from __future__ import annotations

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import BATCH, batch, loss_fn, make_optimizer, mlp


def _train(config, path, steps, load, save, start):
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    user = mpar.load_checkpoint(path, model, opt) if load else None

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    for s in range(start, start + steps):
        x, y = batch("mlp", s)
        shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        train(model, x[shard], y[shard])
        opt.step()
        opt.zero_grad()
    if save:
        mpar.save_checkpoint(path, model, opt, user_content={"step": start + steps})
    return user, model.state_dict()


def _reference(steps):
    net = mlp()
    opt = make_optimizer("adamw", net.parameters())
    for s in range(steps):
        x, y = batch("mlp", s)
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict(), opt.state_dict()


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (({"pipeline_parallel_degree": 2, "microbatches": 2}, 2), ({"zero": {"stage": 3}}, 2)),
        (
            ({"zero": {"stage": 1}}, 2),
            ({"pipeline_parallel_degree": 2, "virtual_stages": 2, "microbatches": 2}, 2),
        ),
    ],
)
def test_save_then_resume_in_another_layout(tmp_path, first, second):
    path = str(tmp_path / "ckpt.pt")
    (cfg1, world1), (cfg2, world2) = first, second
    run_distributed(_train, world1, args=(cfg1, path, 2, False, True, 0), timeout=120)
    ref_state, ref_opt = _reference(2)
    saved = torch.load(path, weights_only=True)  # plain PyTorch can read it
    net = mlp()
    net.load_state_dict(saved["model"])
    for name, tensor in ref_state.items():
        torch.testing.assert_close(saved["model"][name], tensor, rtol=1e-5, atol=1e-6)
    plain = make_optimizer("adamw", net.parameters())
    plain.load_state_dict(saved["optimizer"])
    assert sorted(saved["optimizer"]["state"]) == sorted(ref_opt["state"])
    for index, entry in ref_opt["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            got = saved["optimizer"]["state"][index][key]
            torch.testing.assert_close(got, entry[key], rtol=1e-5, atol=1e-7)
    results = run_distributed(_train, world2, args=(cfg2, path, 2, True, False, 2), timeout=120)
    final_ref, _ = _reference(4)
    for user, state in results:
        assert user == {"step": 2}
        for name, tensor in final_ref.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _interrupted_save(path):
    import mpar

    mpar.init()
    model = mpar.DistributedModel(mlp())
    mpar.save_checkpoint(path, model, user_content="good")
    original = torch.save

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    torch.save = broken_save
    try:
        mpar.save_checkpoint(path, model, user_content="bad")
    except mpar.checkpoint.CheckpointError as exc:
        message = str(exc)
    finally:
        torch.save = original
    return message, mpar.load_checkpoint(path, model)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    ((message, user),) = run_distributed(_interrupted_save, 1, args=(str(path),), timeout=60)
    assert "disk full" in message
    assert user == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def _load_missing(path):
    import mpar

    mpar.init()
    mpar.load_checkpoint(path, mpar.DistributedModel(mlp()))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(DistributedTestError, match="does not exist"):
        run_distributed(_load_missing, 1, args=(str(tmp_path / "nope.pt"),), timeout=60)
