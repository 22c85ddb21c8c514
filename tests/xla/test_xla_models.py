"""Real models on XLA: traced stages (a TinyGPT-like model and a Hugging Face Llama)
train on PJRT's CPU device at pp=2 and at pp=2 x dp=2 with ZeRO-2, transparently.

Neither model is an ``nn.Sequential``: each is captured with ``torch.export`` on the
host, cut into traced stages and only then moved to the ranks' XLA devices. The
oracle is the same model trained with plain torch in one CPU process on the whole
batch (fp32); XLA's CPU kernels sum in another order, hence ``tests/xla``'s wider
tolerances. Skipped where torch_xla is not installed; CI's XLA job runs it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torch_xla", reason="needs torch_xla (run by CI's XLA job, .ci/xla)")
pytest.importorskip("transformers")

from mpar._tree import tree_map
from mpar.testing import run_distributed
from tests.multiproc import _hf_cases as hf
from tests.multiproc import _pipeline_cases as gpt

STEPS = 2
TOL = {"rtol": 1e-4, "atol": 1e-5}
ENV = {"PJRT_DEVICE": "CPU"}
LAYOUTS = {
    # name: (config, world size)
    "pp2": ({"pipeline_parallel_degree": 2, "microbatches": 4}, 2),
    "pp2xdp2-zero2": ({"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 2}}, 4),
}
MODELS = ("tiny_gpt", "hf_llama")


def _train(model: str, config: dict[str, Any]) -> dict[str, Any]:
    """Rank body: one model trained under ``config`` on XLA; every tensor moved to the
    CPU."""
    config = {**config, "device": "xla"}
    if model == "tiny_gpt":
        got = gpt.train_ranks(config, "gpt", "sgd", STEPS)
    else:
        got = hf.train_ranks(["llama"], config, STEPS)["llama"]
    return tree_map(lambda t: t.detach().cpu(), got)


def _reference(model: str) -> dict[str, Any]:
    return (
        gpt.reference("gpt", "sgd", STEPS) if model == "tiny_gpt" else hf.reference("llama", STEPS)
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_traced_model_on_xla_is_transparent(layout, model):
    config, world = LAYOUTS[layout]
    results = run_distributed(_train, world, args=(model, config), env=ENV, timeout=840)
    ref = _reference(model)
    for got in results:
        assert got["param_devices"] == ["xla"], got["param_devices"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        assert set(got["state"]) == set(ref["state"])
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
        for got_step, want_step in zip(got.get("grads", []), ref.get("grads", [])):
            for name, grad in got_step.items():
                torch.testing.assert_close(grad, want_step[name], **TOL, msg=name)
