"""save_pretrained faults: a rank killed mid-save, two jobs saving at once, saving again
into a folder, a full disk, and loads of what a save left behind.

Nothing may be lost, mixed or silent: the folder holds the earlier save or the new one,
whole, for ``mpar.load_pretrained`` and for ``transformers``' ``from_pretrained`` (no
zeros, no half-written tensor, no stale shard of an earlier save), and every failure is a
``CheckpointError`` naming the cause.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc import _hf_cases as hf

transformers = pytest.importorskip("transformers")

ZERO3_DP2 = {"zero": {"stage": 3}, "microbatches": 1}
"""Two data-parallel ranks, each writing its ZeRO-3 shard's part of every tensor."""


def _net(version: int, kind: str = "gpt2") -> torch.nn.Module:
    """GPT-2 (for transformers' loader) or a plain MLP (cheaper: no transformers in the
    ranks), different values per ``version`` (0: the earlier save, 1: the new one)."""
    if kind == "gpt2":
        net = hf.build("gpt2")
    else:
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(8, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.Linear(48, 4)
        )
    with torch.no_grad():
        for p in net.parameters():
            p.add_(float(version))
    return net


def _expected(version: int, kind: str = "gpt2") -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _net(version, kind).state_dict().items()}


def _model(version: int, kind: str = "gpt2") -> Any:
    """Partitioned at once: each rank holds (and writes) its ZeRO-3 shard."""
    import mpar

    if kind == "gpt2":
        ids = torch.zeros(2, 8, dtype=torch.long)
        return mpar.DistributedModel(_net(version), example_kwargs={"input_ids": ids})
    return mpar.DistributedModel(_net(version, kind), example_inputs=(torch.zeros(2, 8),))


def _held(root: Path, kind: str) -> int:
    """The version the safetensors files in ``root`` hold, read in this process the way
    mpar.load_pretrained reads them (a committed save checked first)."""
    from mpar.checkpoint._safetensors import Checkpoint

    ckpt = Checkpoint(root)
    state = {
        k: ckpt.read(k, 0, ckpt.shapes[k].numel()).reshape(ckpt.shapes[k]) for k in ckpt.shapes
    }
    want = _expected(0, kind)
    assert set(state) <= set(want) and len(state) >= len(want) - 1  # (GPT-2: lm_head is tied)
    return _which({**want, **state}, "the files", kind, keys=list(state))


def _die(*args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(moment: str) -> None:
    """Make this process die (SIGKILL) at ``moment`` of the next save_pretrained."""
    import mpar

    rank = mpar.rank()
    if moment == "write":  # rank 1: its first write done, the others not
        pwrite, count = os.pwrite, [0]

        def dying(*args: Any) -> int:
            count[0] += 1
            return _die() if count[0] > 1 else pwrite(*args)  # type: ignore[func-returns-value]

        if rank == 1:
            os.pwrite = dying
        return
    from mpar.checkpoint import _dirs, _hf_dirs, _hf_save

    if moment == "create" and rank == 0:  # the first file created, the others not
        create = _hf_save.create_files
        _hf_save.create_files = lambda root, files: (create(root, files[:1]), _die())
    elif moment == "written" and rank == 0:  # every part written, before the agreement
        _hf_save.agree = _die
    elif moment == "commit" and rank == 0:  # marked complete, not swapped in
        _hf_dirs.commit = _die
    elif moment == "swapped" and rank == 0:  # swapped in, the earlier content not removed
        exchange = _dirs._exchange
        _dirs._exchange = lambda a, b: (exchange(a, b), _die())
    elif moment == "renamed" and rank == 0:  # no one-step swap: between the two renames
        _dirs._exchange = lambda a, b: False
        rename = os.rename
        os.rename = lambda a, b: (rename(a, b), _die() if ".mpar-old" in str(b) else None)


def _save_twice(root: str, moment: str, kind: str) -> None:
    """Save version 0 into ``root``, then version 1 with a rank killed at ``moment``."""
    import mpar

    size = "20KB" if kind == "gpt2" else "4KB"
    mpar.init(ZERO3_DP2)
    mpar.save_pretrained(_model(0, kind), root, max_shard_size=size)
    new = _model(1, kind)
    _arm(moment)
    mpar.save_pretrained(new, root, max_shard_size=size)  # the same file names


def _mpar_load(root: str) -> dict[str, torch.Tensor]:
    import mpar

    mpar.init()
    model = mpar.DistributedModel(hf.build("gpt2"))
    mpar.load_pretrained(model, root)
    return model.state_dict()


def _which(
    state: dict[str, torch.Tensor], where: str, kind: str = "gpt2", keys: list[str] | None = None
) -> int:
    """The version ``state`` equals, whole; fails on a mix, zeros or anything else."""
    for version in (0, 1):
        want = _expected(version, kind)
        if all(torch.equal(state[k], want[k]) for k in keys or want):
            return version
    raise AssertionError(f"{where} loads neither the earlier save nor the new one, whole")


def _loads_as(root: Path, mpar_job: bool = True) -> int:
    """The version both loaders read from ``root`` (mpar's in a job of its own, or its
    reader here); and no file beyond the marker's list."""
    if mpar_job:
        (state,) = run_distributed(_mpar_load, 1, args=(str(root),), timeout=60)
        ours = _which(state, "mpar.load_pretrained")
    else:
        ours = _held(root, "gpt2")
    net, info = transformers.GPT2LMHeadModel.from_pretrained(root, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    theirs = _which(net.state_dict(), "transformers' from_pretrained")
    assert ours == theirs
    listed = json.loads((root / "mpar-complete.json").read_text())["files"]
    assert sorted(os.listdir(root)) == sorted([*listed, "mpar-complete.json"])
    shards = [n for n in listed if n.endswith(".safetensors")]
    assert "config.json" in listed and ("model.safetensors.index.json" in listed) == (
        len(shards) > 1
    )
    return ours


def _save_once(root: str, version: int, kind: str = "gpt2") -> None:
    import mpar

    mpar.init()
    mpar.save_pretrained(_model(version, kind), root, max_shard_size="5KB")


def _kill_case(tmp_path: Path, moment: str, expect: int, kind: str = "gpt2") -> None:
    """Kill a rank at ``moment`` of a save over an earlier one: ``root`` must then load as
    version ``expect``, whole (GPT-2: in both loaders; the MLP: with mpar's reader)."""
    root = tmp_path / "out"
    with pytest.raises(DistributedTestError):  # the victim died; the other rank stopped
        run_distributed(_save_twice, 2, args=(str(root), moment, kind), timeout=120)
    if kind != "gpt2":
        assert _held(root, kind) == expect
        return
    if moment == "renamed":  # the earlier save waits beside the folder: named, then restored
        with pytest.raises(DistributedTestError, match="interrupted while it replaced it"):
            run_distributed(_mpar_load, 1, args=(str(root),), timeout=60)
        run_distributed(_save_once, 1, args=(str(root), 1), timeout=60)
    assert _loads_as(root) == expect


@pytest.mark.timeout(200)
def test_a_rank_killed_mid_save_leaves_the_earlier_save_whole(tmp_path):
    # Before: files were written in place; a kill left full-size files with zeros under
    # an index that looked complete, and both loaders loaded them without an error.
    # (GPT-2 in both loaders, at every moment: the slow test below.)
    _kill_case(tmp_path, "write", expect=0, kind="mlp")


_MOMENTS = [
    ("create", 0),
    ("write", 0),
    ("written", 0),
    ("commit", 0),
    ("swapped", 1),
    ("renamed", 1),
]
"""Where a rank dies (rank 1 for write, else rank 0), and the save the folder then holds
(renamed: after the next save)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("moment", "expect"), _MOMENTS, ids=[m[0] for m in _MOMENTS])
def test_a_rank_killed_at_any_moment_of_a_save_leaves_one_save_whole(tmp_path, moment, expect):
    _kill_case(tmp_path, moment, expect)


# ------------------------------------------------------------- two writers
def _save_at_once(root: str, start_dir: str, name: str, version: int) -> str | None:
    """Both jobs reach a start line, then save with slow writes; the error, or None."""
    import mpar

    mpar.init(ZERO3_DP2)
    model = _model(version, "mlp")
    pwrite = os.pwrite
    os.pwrite = lambda *a: (time.sleep(0.2), pwrite(*a))[1]  # a slow disk
    Path(start_dir, f"{name}-{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(start_dir)) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    if name == "b":
        time.sleep(0.3)  # a starts first
    try:
        mpar.save_pretrained(model, root, max_shard_size="4KB")
    except mpar.CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(200)
def test_two_jobs_saving_into_one_folder_one_wins_whole_the_other_names_it(tmp_path):
    # Before: both exited 0 and the folder held a mix of the two models.
    root, start = tmp_path / "out", tmp_path / "start"
    start.mkdir()
    results: dict[str, list[str | None]] = {}

    def job(name: str, version: int) -> None:
        args = (str(root), str(start), name, version)
        results[name] = run_distributed(_save_at_once, 2, args=args, timeout=150)

    threads = [threading.Thread(target=job, args=(n, v)) for n, v in (("a", 0), ("b", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {"a", "b"}, "a job failed (its traceback is above)"
    winners = [name for name, outcome in results.items() if outcome == [None, None]]
    assert len(winners) == 1, results  # one saves; every rank of the other is refused
    (loser,) = set(results) - set(winners)
    for message in results[loser]:
        assert message is not None and "another job is saving a model into" in message
        assert "pid " in message and "saving since" in message  # names the first job
    assert _held(root, "mlp") == {"a": 0, "b": 1}[winners[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "start"]  # nothing left


# ------------------------------------------------------------- saving again
def _save_series(root: str) -> list[str]:
    """Save into one folder again and again with other shard counts; then into a folder
    that holds other files (refused), then with overwrite=True. The refusals' texts."""
    import mpar

    mpar.init()
    refused = []
    for version, size in ((0, "8KB"), (1, "30KB"), (0, "10MB"), (1, "20KB")):
        mpar.save_pretrained(_model(version), root, max_shard_size=size)
    Path(root, "tokenizer.json").write_text("{}")
    for target in (root, str(Path(root).parent / "foreign")):
        try:
            mpar.save_pretrained(_model(0), target)
        except mpar.CheckpointError as exc:
            refused.append(str(exc))
    mpar.save_pretrained(_model(0), str(Path(root).parent / "foreign"), overwrite=True)
    return refused


def test_saving_again_replaces_the_folder_whole_and_foreign_content_needs_overwrite(tmp_path):
    # Before: old shards and a stale index stayed; after sharded A then single-file B,
    # mpar.load_pretrained loaded A.
    root, foreign = tmp_path / "out", tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (refused_own, refused_foreign) = run_distributed(
        _save_series, 1, args=(str(root),), timeout=120
    )[0]
    assert "holds files an earlier save did not write (1: ['tokenizer.json'])" in refused_own
    assert "holds other files (1: ['notes.txt'])" in refused_foreign
    assert "overwrite=True" in refused_foreign
    (root / "tokenizer.json").unlink()
    assert _loads_as(root, mpar_job=False) == 1  # the last save: none of the earlier files
    assert _held(foreign, "gpt2") == 0 and not (foreign / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "out"]


# ------------------------------------------------------------- a full disk
def _save_on_a_full_disk(root: str, where: str) -> str | None:
    """Save version 1 over version 0 while the disk is full: for the space reserved by
    rank 0 (``reserve``) or, on a file system that cannot reserve, at rank 1's first write
    (``write``). The error, or None."""
    import mpar

    mpar.init(ZERO3_DP2)
    mpar.save_pretrained(_model(0, "mlp"), root, max_shard_size="4KB")
    new = _model(1, "mlp")

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "reserve" and mpar.rank() == 0:
        os.posix_fallocate = full
    elif where == "write" and mpar.rank() == 1:
        os.pwrite = full
    try:
        mpar.save_pretrained(new, root, max_shard_size="4KB")
    except mpar.CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["reserve", pytest.param("write", marks=pytest.mark.slow)])
def test_a_full_disk_is_an_error_naming_the_folder_and_bytes_and_leaves_nothing(tmp_path, where):
    # Before: a bare OSError [Errno 28] from os.pwrite without a path, the partial file
    # left, and the disk left full.
    root = tmp_path / "out"
    for message in run_distributed(_save_on_a_full_disk, 2, args=(str(root), where), timeout=150):
        assert message is not None, "the save succeeded on a full disk"
        assert f"no space left on device under {str(tmp_path)!r}: the save needs " in message
        assert "bytes free" in message and "partial files are removed" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder
    assert _held(root, "mlp") == 0


# ------------------------------------------------------------- loads
def test_loaders_refuse_an_uncommitted_or_damaged_save(tmp_path):
    import shutil

    from mpar.checkpoint import CheckpointError
    from mpar.checkpoint._safetensors import Checkpoint

    root = tmp_path / "out"
    run_distributed(_save_once, 1, args=(str(root), 0, "mlp"), timeout=60)
    Checkpoint(root)  # committed: loads
    pending = tmp_path / ".out.mpar-tmp-0123456789ab"
    shutil.copytree(root, pending)
    with pytest.raises(CheckpointError, match=r"never committed .* load '.*/out'"):
        Checkpoint(pending)
    shard = sorted(root.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(
        CheckpointError, match=rf"{shard.name}', written by save_pretrained, is truncated"
    ):
        Checkpoint(root)


def test_a_write_the_file_system_lost_is_found_by_reading_back(tmp_path, monkeypatch):
    from mpar.checkpoint import CheckpointError
    from mpar.checkpoint._safetensors import create_files, plan_files, write_ranges

    (layout,) = plan_files([("w", torch.Size([64]), torch.float32)], 1 << 20)
    create_files(tmp_path, [layout])
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: len(data))  # "written"
    with pytest.raises(CheckpointError, match=r"model.safetensors: the bytes of 'w' read back"):
        write_ranges(tmp_path, layout, [("w", 0, torch.ones(64))])
