"""Training from a Hugging Face checkpoint: save_pretrained, meta build, load_pretrained.

Each rank body saves the family's model with ``mpar.save_pretrained`` into several
shard files, builds the model on meta, loads the files with
``mpar.load_pretrained`` (each rank reading only what it stores) and trains; the
losses and updated parameters must equal one process training
``transformers``' ``from_pretrained`` on the same files (fp32). The trained model
is saved again with ``save_pretrained``: the files must hold the gathered
``state_dict()`` and load in ``from_pretrained`` with no missing or unexpected keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc import _hf_cases as hf
from tests.multiproc import _meta_cases as cases

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

STEPS = 3


def _reference(family: str, path: Path) -> dict[str, Any]:
    cls = type(hf.build(family))
    net, info = cls.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    opt = hf._optimizer(net.parameters())
    losses = []
    for s in range(STEPS):
        loss = net(**hf.batch(family, s)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": net.state_dict()}


def _saved(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out |= load_file(path / name)
    return out


def _run(family: str, world: int, config: dict[str, Any], root: Path) -> None:
    results = run_distributed(
        cases.pretrained_run, world, args=(family, config, str(root), STEPS), timeout=400
    )
    src = root / "src"
    assert len(list(src.glob("model-*.safetensors"))) >= 2  # several shard files
    assert (src / "config.json").is_file()
    ref = _reference(family, src)
    where = f"{family} under {config}"
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6, msg=where
        )
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(
                r["state"][name], tensor, rtol=1e-5, atol=1e-5, msg=f"{where}: {name}"
            )
    # round trip: the trained model's files hold its gathered state, and load in transformers
    saved, state = _saved(root / "out"), results[0]["state"]
    for key, value in saved.items():
        assert torch.equal(value, state[key]), key
    cls = type(hf.build(family))
    _, info = cls.from_pretrained(root / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


PP2_DP2_ZERO3 = {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}}


@pytest.mark.timeout(450)
def test_llama_pretrained_pp2_dp2_zero3(tmp_path):
    _run("llama", 4, PP2_DP2_ZERO3, tmp_path)


_ZEROS = {
    "zero0": {"stage": 0},
    "zero3": {"stage": 3},
    "zero3-offload": {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"},
}


@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("zero", list(_ZEROS))
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_every_family_pretrained_pp2_dp2(family, zero, tmp_path):
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": _ZEROS[zero]}
    if "offload" in zero:
        config["pipeline"] = "simple"
    _run(family, 4, config, tmp_path)
