"""A Hugging Face GPT-2, built from configuration, trains transparently under pp=2."""

from __future__ import annotations

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import hf_reference, hf_train_ranks

pytest.importorskip("transformers")


@pytest.mark.parametrize("microbatches", [4, 3])
def test_hf_gpt2_pp2_transparent(microbatches):
    config = {"pipeline_parallel_degree": 2, "microbatches": microbatches}
    results = run_distributed(hf_train_ranks, 2, args=(config, 3), timeout=240)
    ref = hf_reference(3)
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6
        )
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(r["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert "transformer.h" in results[0]["plan"]
