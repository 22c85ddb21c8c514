"""Two ranks on one GPU (skipped without a GPU): pipelines and ZeRO computing on CUDA.

NCCL refuses two ranks on one GPU, so these ranks talk through gloo, host-staged
(``backend: gloo``: each transfer and collective copies through the host, see
docs/devices.md); the stages, the step and the offload paths run on the GPU. With
several GPUs each rank takes its own and the same configurations run on NCCL
(``backend: auto``). The oracle is the CPU one (plain torch, one process, the whole
batch, fp32); GPU and CPU kernels sum in different orders, hence ``rtol=1e-4``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpar._tree import tree_map
from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import reference, train_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 2
TOL = {"rtol": 1e-4, "atol": 1e-5}
GPU = {"CUDA_VISIBLE_DEVICES": "0"}
CASES = {
    # name: (config, model, optimizer)
    "pp2-gpt-interleaved": ({"pipeline_parallel_degree": 2, "microbatches": 4}, "gpt", "sgd"),
    "pp2-gpt-zero_bubble": (
        {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zero_bubble"},
        "gpt",
        "sgd",
    ),
    "dp2-zero3-offload": (
        {
            "microbatches": 2,
            "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
        },
        "mlp",
        "adamw",
    ),
}


def _train(config: dict[str, Any], model: str, optimizer: str) -> dict[str, Any]:
    result = train_ranks({**config, "device": "cuda", "backend": "gloo"}, model, optimizer, STEPS)
    result["peak"] = int(torch.cuda.max_memory_allocated())
    return tree_map(lambda t: t.detach().cpu(), result)  # no CUDA tensor leaves the rank


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_on_one_gpu_are_transparent(case):
    config, model, optimizer = CASES[case]
    results = run_distributed(_train, 2, args=(config, model, optimizer), env=GPU, timeout=240)
    ref = reference(model, optimizer, STEPS)
    for got in results:
        assert got["param_devices"] == ["cuda"], got["param_devices"]
        assert got["peak"] > 0
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
        for got_step, want_step in zip(got["grads"], ref["grads"]):
            for name, grad in got_step.items():
                torch.testing.assert_close(grad, want_step[name], **TOL, msg=name)


def _train_placed(config: dict[str, Any], steps: int) -> dict[str, Any]:
    result = train_ranks({**config, "device": "cuda", "backend": "gloo"}, "gpt", "adamw", steps,
                         None, 8)  # fmt: skip
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, result)


@pytest.mark.timeout(300)
def test_zero_bubble_placed_from_measured_times_on_the_gpu():
    """The measured placement with CUDA stages: steps 3 to 5 are timed with each action
    waiting for the GPU (``_device.synchronize``), every rank switches at the sixth to
    the schedule the gathered times give, and training stays exact."""
    from mpar.schedule import lower, peak_in_flight, zero_bubble

    steps = 7
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zero_bubble",
              "active_microbatches": 3}  # fmt: skip
    results = run_distributed(_train_placed, 2, args=(config, steps), env=GPU, timeout=240)
    ref = reference("gpt", "adamw", steps, batch_size=8)
    for got in results:
        assert got["param_devices"] == ["cuda"], got["param_devices"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, **TOL, msg=name)
    schedules = [got["schedule"] for got in results]
    assert all(s.actions == schedules[0].actions for s in schedules)
    costs = results[0]["placement_costs"]
    assert costs is not None and all(got["placement_costs"] == costs for got in results)
    assert all(f > 0 for f in costs.forward)
    assert (
        schedules[0].actions
        == lower(zero_bubble(2, 2, 4, active_microbatches=3, costs=costs), zero_stage=0).actions
    )
    assert max(peak_in_flight(schedules[0])) <= 3
