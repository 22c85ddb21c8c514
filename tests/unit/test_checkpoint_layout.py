"""Pure parts of checkpoints: flat runs as boxes, shard files, directories."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch

from mpar.checkpoint._boxes import run_boxes
from mpar.checkpoint._dirs import LATEST, MARKER, commit, new_tmp_dir, remove_stale, resolve
from mpar.checkpoint._owner import Owner, write_owner


@pytest.mark.parametrize("shape", [(), (7,), (4, 5), (3, 4, 5), (2, 3, 1, 4), (3, 0, 2)])
def test_boxes_cover_every_run_exactly_once_in_order(shape):
    numel = math.prod(shape)
    whole = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = run_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        covered = []
        for box in boxes:
            index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
            values = whole[index].reshape(-1)
            expected = torch.arange(box.flat_start, box.flat_start + box.numel)
            assert torch.equal(values, expected), (shape, start, stop, box)
            covered.append(values)
        assert torch.equal(torch.cat(covered), torch.arange(start, stop))


def test_a_run_outside_the_tensor_is_an_error():
    assert run_boxes((4, 5), 3, 3) == []
    with pytest.raises(ValueError, match=r"run \[18, 21\) is not inside a tensor of 20"):
        run_boxes((4, 5), 18, 21)


def test_commit_renames_then_points_latest_and_keeps_the_last(tmp_path):
    for n in range(1, 4):
        tmp, name = new_tmp_dir(tmp_path)
        assert name == f"ckpt-{n:06d}" and tmp.name.startswith(f".tmp-{name}-")
        (tmp / ".metadata").write_bytes(b"")
        final = commit(tmp, name, {"format": "x"}, keep_last=2)
        assert (final / MARKER).is_file()
        assert (tmp_path / LATEST).read_text().strip() == name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000002", "ckpt-000003", LATEST]
    assert resolve(tmp_path) == ("dcp", tmp_path / "ckpt-000003")


def test_an_uncommitted_directory_is_never_loaded(tmp_path):
    tmp, _ = new_tmp_dir(tmp_path)
    (tmp / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        resolve(tmp_path)
    with pytest.raises(ValueError, match="no completion marker"):
        resolve(tmp)
    assert remove_stale(tmp_path) == []  # its owner (this process) still runs
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_owner(tmp, Owner(Owner.here().host, gone.pid, None, 0.0))
    assert remove_stale(tmp_path) == [tmp.name]
    assert list(tmp_path.iterdir()) == []


def test_without_latest_the_newest_complete_directory_is_loaded(tmp_path):
    for name in ("ckpt-000001", "ckpt-000002", "ckpt-000003"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
    (tmp_path / "ckpt-000001" / MARKER).write_text("{}")
    (tmp_path / "ckpt-000002" / MARKER).write_text("{}")
    assert resolve(tmp_path) == ("dcp", tmp_path / "ckpt-000002")
    (tmp_path / LATEST).write_text("ckpt-000003\n")
    with pytest.raises(ValueError, match=r"not a complete checkpoint directory; load one of \["):
        resolve(tmp_path)
    for name in ("ckpt-000001", "ckpt-000002"):
        (tmp_path / name / MARKER).unlink()
    with pytest.raises(ValueError, match="no complete checkpoint is left under it: save a new"):
        resolve(tmp_path)  # not "load one of [] explicitly"


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    import pickle

    from mpar.checkpoint._dcp import SafeReader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match=r"refers to posix.system"):
        SafeReader(str(tmp_path)).read_metadata()
