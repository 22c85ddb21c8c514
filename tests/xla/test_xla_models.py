"""Real models on XLA: traced stages (a TinyGPT-like model and a Hugging Face Llama)
train on PJRT's CPU device at pp=2 and at pp=2 x dp=2 with ZeRO-2, transparently.

Neither model is an ``nn.Sequential``: each is captured with ``torch.export`` on the
host, cut into traced stages and only then moved to the ranks' XLA devices. The
oracle is the same model trained with plain torch in one CPU process on the whole
batch (fp32); XLA's CPU kernels sum in another order, hence ``tests/xla``'s wider
tolerances. Skipped where torch_xla is not installed; CI's XLA job runs it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("torch_xla", reason="needs torch_xla (run by CI's XLA job, .ci/xla)")
pytest.importorskip("transformers")

from mpar._tree import tree_map
from mpar.comm import free_port
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
    """One model trained under ``config`` on XLA; every tensor moved to the CPU."""
    config = {**config, "device": "xla"}
    if model == "tiny_gpt":
        got = gpt.train_ranks(config, "gpt", "sgd", STEPS)
    else:
        got = hf.train_ranks(["llama"], config, STEPS)["llama"]
    return tree_map(lambda t: t.detach().cpu(), got)


def _train_all(config: dict[str, Any], ports: list[int]) -> list[dict[str, Any]]:
    """Rank body: both models in turn in one process (torch_xla starts once per rank),
    each at a rendezvous port of its own; a failing model returns its traceback."""
    import os

    import mpar

    results = []
    for model, port in zip(MODELS, ports):
        os.environ["MASTER_PORT"] = str(port)
        try:
            results.append(_train(model, config))
        except Exception:
            results.append({"error": traceback.format_exc()})
        finally:
            mpar.shutdown()
    return results


@pytest.fixture(scope="module")
def trained() -> Callable[[str, str], list[dict[str, Any]]]:
    done: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def results(layout: str, model: str) -> list[dict[str, Any]]:
        if (layout, model) not in done:
            config, world = LAYOUTS[layout]
            ports = [free_port() for _ in MODELS]
            ranks = run_distributed(_train_all, world, args=(config, ports), env=ENV, timeout=600)
            for i, name in enumerate(MODELS):
                done[layout, name] = [rank[i] for rank in ranks]
        return done[layout, model]

    return results


def _reference(model: str) -> dict[str, Any]:
    return (
        gpt.reference("gpt", "sgd", STEPS) if model == "tiny_gpt" else hf.reference("llama", STEPS)
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_traced_model_on_xla_is_transparent(layout, model, trained):
    ref = _reference(model)
    for got in trained(layout, model):
        assert "error" not in got, got.get("error")
        assert got["param_devices"] == ["xla"], got["param_devices"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        assert set(got["state"]) == set(ref["state"])
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
        for got_step, want_step in zip(got.get("grads", []), ref.get("grads", [])):
            for name, grad in got_step.items():
                torch.testing.assert_close(grad, want_step[name], **TOL, msg=name)
