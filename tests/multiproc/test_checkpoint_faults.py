"""Checkpoint faults: two jobs saving into one root, a full disk, files removed
during a save, corrupt or partial checkpoints, loads into another model.

Nothing may be lost or silent: a checkpoint marked complete always has every
file its metadata names, a failed save raises ``CheckpointError`` (an
``Exception``) naming the cause and leaves no temporary directory, and a
corrupt checkpoint is refused at ``load_checkpoint`` naming the file.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import batch, make_optimizer, mlp, train_loss

ZERO1_DP2 = {"zero": {"stage": 1}, "microbatches": 1}


def _model_and_opt(config, net=None):
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(net if net is not None else mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))

    x, y = batch("mlp", 0)
    half = x.shape[0] // mpar.dp_size()
    shard = slice(mpar.dp_rank() * half, (mpar.dp_rank() + 1) * half)
    train_loss(model, x[shard], y[shard])
    opt.step()
    opt.zero_grad()
    return model, opt


# ------------------------------------------------------------- two writers
def _slow_writes(seconds):
    """Every shard write of this process takes ``seconds`` longer (a slow disk)."""
    from mpar.checkpoint import _dcp

    write = _dcp.BoundedWriter.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return write(self, plan, planner)

    _dcp.BoundedWriter.write_data = slow


def _start_line(start_dir, name, processes=4, timeout=60.0):
    """Wait until every process of both jobs has built its model, so that the
    jobs' saves start ``delay`` apart whatever their start-up times were."""
    import os
    from pathlib import Path

    start = Path(start_dir)
    (start / f"{name}-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while len(list(start.iterdir())) < processes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other job never reached the start line in {start}")
        time.sleep(0.01)


def _save_repeatedly(root, start_dir, name, delay, saves):
    """Save ``saves`` times ``delay`` s after both jobs are ready; count the saves
    refused because another job was saving into the same root."""
    import mpar

    model, opt = _model_and_opt(ZERO1_DP2)
    _slow_writes(0.3)
    _start_line(start_dir, name)
    time.sleep(delay)
    done, refused = 0, 0
    for _ in range(saves):
        try:
            mpar.save_checkpoint(root, model, opt, user_content={"rank0": mpar.rank()})
            done += 1
        except mpar.CheckpointError as exc:
            assert "another job is saving" in str(exc), exc
            refused += 1
        time.sleep(0.05)
    return done, refused


def _two_jobs(tmp_path, delay):
    root, start_dir = tmp_path / "checkpoints", tmp_path / "start"
    root.mkdir()
    start_dir.mkdir()
    results = {}

    def job(name, wait):
        args = (str(root), str(start_dir), name, wait, 3)
        results[name] = run_distributed(_save_repeatedly, 2, args=args, timeout=120)

    threads = [threading.Thread(target=job, args=(n, w)) for n, w in (("a", 0.0), ("b", delay))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _check_root(root):
    """Every complete checkpoint has all its files; nothing temporary is left."""
    from mpar.checkpoint import _dirs
    from mpar.checkpoint._verify import check_files

    complete = _dirs.complete_dirs(root)
    assert complete, "no checkpoint was committed"
    for directory in complete:
        check_files(directory)
    assert (root / "latest").read_text().strip() == complete[-1].name
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    return complete


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.4])
def test_two_jobs_saving_into_one_root_never_commit_a_partial_checkpoint(tmp_path, delay):
    results = _two_jobs(tmp_path, delay)
    assert set(results) == {"a", "b"}, "a job failed (its traceback is above)"
    counts = [r[0] for r in results.values()]  # rank 0's (done, refused) of each job
    for job in results.values():
        assert job[0] == job[1], "both ranks of a job must see the same outcome"
    done = sum(c[0] for c in counts)
    assert sum(c[1] for c in counts) >= 1, "the saves never overlapped: the test tests nothing"
    assert len(_check_root(tmp_path / "checkpoints")) == done


def _save_losing_a_file(root):
    """The second save's files are removed by someone else before its commit."""
    import mpar
    from mpar.checkpoint import _dcp

    model, opt = _model_and_opt(ZERO1_DP2)
    mpar.save_checkpoint(root, model, opt)
    write = _dcp.BoundedWriter.write_data

    def write_then_lose(self, plan, planner):
        result = write(self, plan, planner)
        result.wait()
        if mpar.rank() == 1:
            for shard in __import__("pathlib").Path(self.path).glob("__1_*.distcp"):
                shard.unlink()
        return result

    _dcp.BoundedWriter.write_data = write_then_lose
    try:
        mpar.save_checkpoint(root, model, opt)
    except Exception as exc:  # an Exception, not DCP's BaseException
        return type(exc).__name__, str(exc)
    return None


def test_a_save_whose_files_vanished_is_not_committed(tmp_path):
    for outcome in run_distributed(_save_losing_a_file, 2, args=(str(tmp_path),), timeout=120):
        assert outcome is not None and outcome[0] == "CheckpointError"
        assert "__1_0.distcp" in outcome[1] and "missing" in outcome[1], outcome
    assert [p.name for p in _check_root(tmp_path)] == ["ckpt-000001"]


def _save_on_a_full_disk(root):
    import mpar
    from mpar.checkpoint import _dcp

    model, opt = _model_and_opt(ZERO1_DP2)

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    if mpar.rank() == 1:
        _dcp.BoundedWriter.write_data = full
    try:
        mpar.save_checkpoint(root, model, opt)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_full_disk_is_a_checkpoint_error_naming_it_and_leaves_no_temporary_files(tmp_path):
    for outcome in run_distributed(_save_on_a_full_disk, 2, args=(str(tmp_path),), timeout=120):
        assert outcome is not None and outcome[0] == "CheckpointError", outcome
        assert "no space left on device" in outcome[1] and "bytes free under" in outcome[1]
    assert [p.name for p in tmp_path.iterdir()] == [".mpar-save.lock"]


# ------------------------------------------------------- corrupt checkpoints
def _save(root, net=None):
    import mpar

    model, opt = _model_and_opt(ZERO1_DP2, net)
    mpar.save_checkpoint(root, model, opt, user_content={"step": 1})
    return model.state_dict()


def _load(path, net=None, strict=True):
    import mpar

    mpar.init()
    model = mpar.DistributedModel(net if net is not None else mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    result = mpar.load_checkpoint(path, model, opt, strict=strict)
    return result, model.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    state = run_distributed(_save, 2, args=(str(root),), timeout=120)[0]
    return root / "ckpt-000001", state


def _biggest_shard(directory):
    return max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(fraction):
    def corrupt(directory):
        shard = _biggest_shard(directory)
        shard.write_bytes(shard.read_bytes()[: int(shard.stat().st_size * fraction)])
        return shard.name

    return corrupt


def _delete(directory):
    shard = _biggest_shard(directory)
    shard.unlink()
    return shard.name


def _garbage_metadata(directory):
    (directory / ".metadata").write_bytes(b"garbage\n12x\x00")
    return ".metadata"


@pytest.mark.parametrize(
    ("corrupt", "says"),
    [
        (_truncate(0.5), "truncated"),
        (_truncate(0.1), "truncated"),
        (_delete, "missing"),
        (_garbage_metadata, "unreadable"),
    ],
)
def test_a_corrupt_checkpoint_is_refused_at_load_naming_the_file(tmp_path, saved, corrupt, says):
    import shutil

    directory = tmp_path / "ckpt-000001"
    shutil.copytree(saved[0], directory)
    name = corrupt(directory)
    with pytest.raises(DistributedTestError, match=rf"CheckpointError: .*{says}") as info:
        run_distributed(_load, 1, args=(str(tmp_path),), timeout=60)
    (line,) = [t for t in str(info.value).splitlines() if t.startswith("mpar.")]
    assert name in line  # named in the error itself, not deep in a traceback


# ------------------------------------------------------------ strict loads
def _shorter_mlp():
    return torch.nn.Sequential(*list(mlp())[:-2])  # without the last two layers (6, 7)


def _longer_mlp():
    return torch.nn.Sequential(*mlp(), torch.nn.Linear(4, 4))


def test_loading_into_a_smaller_or_larger_model_raises_unless_not_strict(tmp_path, saved):
    _, state = saved
    with pytest.raises(DistributedTestError, match=r"4 entries the model lacks \['6.bias'"):
        run_distributed(_load, 1, args=(str(saved[0]), _shorter_mlp()), timeout=60)
    with pytest.raises(DistributedTestError, match=r"no entries for 2 model keys \['8.weight'"):
        run_distributed(_load, 1, args=(str(saved[0]), _longer_mlp()), timeout=60)
    ((result, loaded),) = run_distributed(
        _load, 1, args=(str(saved[0]), _shorter_mlp(), False), timeout=60
    )
    assert result.user_content == {"step": 1}
    assert result.unexpected_keys == ["6.bias", "6.weight", "7.bias", "7.weight"]
    assert result.missing_keys == [] and result.mismatched_keys == []
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    ((result, _),) = run_distributed(
        _load, 1, args=(str(saved[0]), _longer_mlp(), False), timeout=60
    )
    assert result.missing_keys == ["8.weight", "8.bias"] and result.unexpected_keys == []
