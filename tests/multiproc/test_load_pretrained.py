"""mpar.load_pretrained: key checks, tied weights, key mapping, dtype casts, and loads
before (deferred) and after partitioning, on a meta-built GPT-2 at pp=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc import _hf_cases as hf
from tests.multiproc import _meta_cases as cases

pytest.importorskip("transformers")
from safetensors.torch import save_file


def _write(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    (root / name).mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, root / name / "model.safetensors")


@pytest.mark.timeout(200)
def test_load_pretrained_checks_maps_casts_and_defers(tmp_path):
    torch.manual_seed(5)
    state = {k: torch.randn_like(v) for k, v in hf.build("gpt2").state_dict().items()}
    del state["lm_head.weight"]  # tied to transformer.wte.weight, as transformers saves it
    _write(tmp_path, "fp32", state)
    _write(tmp_path, "bf16", {f"old.{k}": v.to(torch.bfloat16) for k, v in state.items()})
    bad = dict(state)
    bad["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(3, 5)
    _write(tmp_path, "bad_shape", bad)
    missing = dict(state)
    del missing["transformer.ln_f.bias"]
    _write(tmp_path, "missing", missing)
    _write(tmp_path, "extra", {**state, "foo.bar": torch.zeros(2)})

    results = run_distributed(cases.load_checks, 2, args=(str(tmp_path),), timeout=180)
    for r in results:
        errors = r["errors"]
        assert (
            "'transformer.h.1.mlp.c_fc.weight': checkpoint (3, 5), model (32, 128)"
            in errors["bad_shape"]
        )
        assert "missing keys ['transformer.ln_f.bias']" in errors["missing"]
        assert "unexpected keys ['foo.bar']" in errors["extra"]
        for key, value in state.items():
            want = value.to(torch.bfloat16).to(torch.float32)
            assert torch.equal(r["deferred"][key], want), key
            assert torch.equal(r["after"][key], value), key
        assert torch.equal(r["after"]["lm_head.weight"], state["transformer.wte.weight"])


def _small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _faults(root: str) -> dict[str, object]:
    """load_pretrained of checkpoints that match nothing, part, or with lossy dtypes."""
    import warnings

    import mpar

    mpar.init()
    model = mpar.DistributedModel(_small())
    out: dict[str, object] = {}
    for name in ("other", "bad_index", "ints", "bools"):
        try:
            mpar.load_pretrained(model, f"{root}/{name}", strict=False)
            out[name] = None
        except (KeyError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpar.load_pretrained(model, f"{root}/part", strict=False)
    out["warnings"] = [str(w.message) for w in caught]
    mpar.load_pretrained(model, f"{root}/ints", allow_lossy_casts=True)
    out["state"] = model.state_dict()
    return out


def test_partial_loads_bad_index_and_lossy_casts_are_reported(tmp_path):
    # Before: another architecture loaded 0 tensors silently, a bad index raised a bare
    # JSONDecodeError without the file, and int64 / bool tensors were cast silently.
    state = _small().state_dict()
    _write(tmp_path, "other", {"model.embed.weight": torch.zeros(4, 4)})
    _write(tmp_path, "part", {"0.weight": torch.ones(3, 4), "extra": torch.ones(1)})
    _write(
        tmp_path, "ints", {k: torch.full_like(v, 2, dtype=torch.int64) for k, v in state.items()}
    )
    _write(tmp_path, "bools", {k: torch.ones_like(v, dtype=torch.bool) for k, v in state.items()})
    (tmp_path / "bad_index").mkdir()
    (tmp_path / "bad_index" / "model.safetensors.index.json").write_text('{"weight_map": {')
    (r,) = run_distributed(_faults, 1, args=(str(tmp_path),), timeout=60)
    assert r["other"].startswith("PretrainedKeyError: ") and "shares no tensor" in r["other"]
    assert "(0 of its 1 tensors match the model's 4)" in r["other"]
    index = tmp_path / "bad_index" / "model.safetensors.index.json"
    assert r["bad_index"].startswith(f"CheckpointError: {index} is not valid JSON")
    for name, kind in (("ints", "int64 -> torch.float32"), ("bools", "bool -> torch.float32")):
        assert r[name].startswith("CheckpointError: ") and kind in r[name], r[name]
        assert "allow_lossy_casts=True" in r[name]
    (message,) = r["warnings"]
    assert "loaded 1 of the model's 4 tensors; 3 missing" in message
    assert "1 checkpoint tensors unused ['extra']" in message
    for key, value in r["state"].items():  # cast when asked for
        assert torch.equal(value, torch.full_like(value, 2.0)), key
