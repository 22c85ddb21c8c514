"""Transparency on XLA devices: pp x dp training on XLA equals one CPU process.

Every rank computes on its XLA device (``device: xla``); on PJRT's CPU device
the ranks communicate through gloo, host-staged (see docs/devices.md). The
oracle is the same model trained with plain torch on the CPU on the whole
batch, in fp32. XLA's CPU kernels (Eigen) sum in another order than torch's,
hence tolerances a little wider than the CPU transparency tests'.

Skipped where torch_xla is not installed (the main suite); CI's XLA job
(``.ci/xla``) runs it with torch_xla and ``PJRT_DEVICE=CPU``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("torch_xla", reason="needs torch_xla (run by CI's XLA job, .ci/xla)")

from mpar._tree import tree_map
from mpar.comm import free_port
from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import mixed_reference, reference, train_ranks

STEPS = 3
TOL = {"rtol": 1e-4, "atol": 1e-5}
OUT_TOL = {"rtol": 1e-4, "atol": 1e-4}
ENV = {"PJRT_DEVICE": "CPU"}


def _train_on_xla(config: dict[str, Any], optimizer: str) -> dict[str, Any]:
    """The CPU tests' training loop with ``device: xla``; every tensor it returns is
    moved to the CPU."""
    result = train_ranks({**config, "device": "xla"}, "mlp", optimizer, STEPS)
    return tree_map(lambda t: t.detach().cpu(), result)


def _train_cases(cases: list[tuple[dict[str, Any], str]], ports: list[int]) -> list[dict[str, Any]]:
    """Rank body: train every case in turn (``mpar.init`` ... ``mpar.shutdown``), in one
    process, so that torch_xla starts once per rank, not once per case; each case
    meets at a rendezvous port of its own. A case that fails returns its traceback
    and the next one still runs."""
    import os

    import mpar

    results = []
    for (config, optimizer), port in zip(cases, ports):
        os.environ["MASTER_PORT"] = str(port)
        try:
            results.append(_train_on_xla(config, optimizer))
        except Exception:
            results.append({"error": traceback.format_exc()})
        finally:
            mpar.shutdown()
    return results


def _check(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for got in results:
        assert "error" not in got, got.get("error")
        assert got["param_devices"] == ["xla"], got["param_devices"]
        assert "xla:0" in got["memory_devices"], got["memory_devices"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        for out, want in zip(got["outputs"], ref["outputs"]):
            torch.testing.assert_close(out, want, **OUT_TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
        for got_step, want_step in zip(got["grads"], ref["grads"]):
            for name, grad in got_step.items():
                torch.testing.assert_close(grad, want_step[name], **TOL, msg=name)


def _pp2(**extra: Any) -> dict[str, Any]:
    return {"pipeline_parallel_degree": 2, "microbatches": 4, **extra}


CASES = {
    # name: (config, world size, optimizer)
    "pp2-m4-simple": (_pp2(pipeline="simple"), 2, "sgd"),
    "pp2-m4-interleaved": (_pp2(pipeline="interleaved"), 2, "adamw"),
    "pp2-v2-interleaved": (_pp2(virtual_stages=2), 2, "sgd"),
    "pp2-v2-simple": (_pp2(pipeline="simple", virtual_stages=2), 2, "sgd"),
    "pp2-recompute-offload": (
        _pp2(activation_checkpointing=True, offload_activations=True),
        2,
        "sgd",
    ),
    "dp2-ddp": ({"microbatches": 2}, 2, "sgd"),
    "dp2-zero1": ({"microbatches": 2, "zero": {"stage": 1}}, 2, "adamw"),
    "pp2-bf16-zero1": (_pp2(microbatches=2, bf16=True, zero={"stage": 1}), 2, "sgd"),
    "pp2xdp2-zero2": (_pp2(microbatches=2, zero={"stage": 2}), 4, "sgd"),
    "pp2xdp2-zero3-offload": (
        _pp2(
            microbatches=2, zero={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
        ),
        4,
        "adamw",
    ),
}


@pytest.fixture(scope="module")
def trained() -> Callable[[str], list[dict[str, Any]]]:
    """Each case's per-rank results; the cases of one world size train in one launch."""
    done: dict[str, list[dict[str, Any]]] = {}

    def results(case: str) -> list[dict[str, Any]]:
        if case not in done:
            world = CASES[case][1]
            names = [name for name, (_, w, _) in CASES.items() if w == world]
            cases = [(CASES[name][0], CASES[name][2]) for name in names]
            ports = [free_port() for _ in cases]
            ranks = run_distributed(_train_cases, world, args=(cases, ports), env=ENV, timeout=600)
            for i, name in enumerate(names):
                done[name] = [rank[i] for rank in ranks]
        return done[case]

    return results


@pytest.mark.parametrize("case", [name for name in CASES if not CASES[name][0].get("bf16")])
def test_xla_pipeline_is_transparent(case, trained):
    _check(trained(case), reference("mlp", CASES[case][2], STEPS))


@pytest.mark.parametrize("case", [name for name in CASES if CASES[name][0].get("bf16")])
def test_xla_bf16_follows_the_mixed_precision_recipe(case, trained):
    """bf16 on XLA against mpar's mixed-precision recipe in plain torch on the CPU
    (the CPU tests' oracle and tolerances: gradients summed in bf16 over
    microbatches and replicas, float32 masters updated by SGD)."""
    ref = mixed_reference("mlp", CASES[case][2], STEPS, torch.bfloat16)
    for got in trained(case):
        assert "error" not in got, got.get("error")
        assert got["param_devices"] == ["xla"], got["param_devices"]
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0.0, atol=1e-2
        )
        for name, tensor in ref["state"].items():
            assert got["state"][name].dtype == torch.float32, name  # the master copy
            torch.testing.assert_close(got["state"][name], tensor, rtol=2e-2, atol=1e-3, msg=name)
