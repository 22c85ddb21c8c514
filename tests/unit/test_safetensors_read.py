"""Reading element ranges of safetensors files (``load_pretrained``'s reader)."""

from __future__ import annotations

import json

import pytest
import torch

from mpar.checkpoint._safetensors import Checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 4, 2, generator=g).to(torch.bfloat16),
        "i64": torch.arange(11, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
    }


def test_ranges_equal_the_reference_reader_and_nothing_stays_mapped(tmp_path):
    tensors = _tensors()
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    ckpt = Checkpoint(tmp_path)
    assert ckpt.shapes == {k: v.shape for k, v in tensors.items()}
    assert ckpt.dtypes["bf16"] == "BF16"
    for key, value in tensors.items():
        flat = value.reshape(-1)
        n = flat.numel()
        for start, stop in [(0, n), (1, n), (n // 2, n // 2 + 1), (2, 2)]:
            got = ckpt.read(key, start, stop)
            assert got.dtype == value.dtype
            assert torch.equal(got, flat[start:stop]), (key, start, stop)
    with open("/proc/self/maps") as maps:
        assert str(tmp_path) not in maps.read()


def test_sharded_checkpoint_and_corrupt_files(tmp_path):
    tensors = _tensors()
    first = {k: tensors[k] for k in ("f32", "i64")}
    second = {k: tensors[k] for k in ("bf16", "mask", "scalar")}
    safetensors_torch.save_file(first, tmp_path / "a.safetensors")
    safetensors_torch.save_file(second, tmp_path / "b.safetensors")
    index = {
        "weight_map": {k: "a.safetensors" for k in first} | {k: "b.safetensors" for k in second}
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    assert torch.equal(ckpt.read("mask", 0, 9), tensors["mask"])
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:-8])  # truncated
    with pytest.raises(ValueError, match="corrupt"):
        Checkpoint(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        Checkpoint(tmp_path)
