"""A real model that does not fit rank 0's ``device_memory`` is not run there to be
profiled: partitioning falls back to the FLOPs profile on fake tensors (issue 24)."""

from __future__ import annotations

import pytest
import torch

from mpar.testing import run_distributed
from mpar.testing.models import GPTConfig, TinyGPT
from tests.multiproc import _meta_cases as cases


def _reference_loss() -> float:
    torch.manual_seed(0)
    net = TinyGPT(GPTConfig(num_layers=4))
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = net(idx)
    return float(torch.nn.functional.cross_entropy(out.flatten(0, 1), idx.flatten()))


@pytest.mark.timeout(200)
def test_model_over_device_memory_is_profiled_on_fake_tensors():
    weights = TinyGPT(GPTConfig(num_layers=4))
    size = sum(p.numel() * p.element_size() for p in weights.parameters())
    # weights fit, weights and gradients do not: rank 0 must not run the model
    over = run_distributed(cases.profile_budget, 2, args=(int(1.5 * size),), timeout=180)
    assert over[0]["weights"] == size
    assert over[0]["real_runs"] == 0
    # without a budget rank 0 times real runs of every block (the check above can fail)
    measured = run_distributed(cases.profile_budget, 2, args=(None,), timeout=180)
    assert measured[0]["real_runs"] > 0
    want = _reference_loss()
    for result in over + measured:
        assert result["loss"] == pytest.approx(want, rel=1e-5)
