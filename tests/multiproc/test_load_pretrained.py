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
