"""Hugging Face families with default configs train transparently through the public API.

The loss is computed inside the model from ``labels``; caches (``use_cache``)
stay at their defaults. The default suite runs every family at pp=2 x dp=2
(4 microbatches of one sample, and ZeRO-3 with 2 microbatches) in one set of
four processes; ``-m slow`` adds pp=2 alone, pp=4, virtual stages, ZeRO 1/2
and offload.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc import _hf_cases as cases

pytest.importorskip("transformers")

STEPS = 2


def _check(results: list[dict[Any, Any]], configs: list[dict[str, Any]]) -> None:
    refs = {f: cases.reference(f, STEPS) for f in cases.FAMILIES}
    for c, config in enumerate(configs):
        for family, ref in refs.items():
            where = f"{family} under {config}"
            total = sum(p.numel() for p in cases.build(family).parameters())
            for r in results:
                got = r[(c, family)]
                torch.testing.assert_close(
                    torch.tensor(got["losses"]),
                    torch.tensor(ref["losses"]),
                    rtol=1e-5,
                    atol=1e-6,
                    msg=where,
                )
                assert sum(got["plan_param_counts"]) == total, where
                for name, tensor in ref["state"].items():
                    torch.testing.assert_close(
                        got["state"][name], tensor, rtol=1e-5, atol=1e-5, msg=f"{where}: {name}"
                    )


@pytest.mark.timeout(660)
def test_every_family_pp2_dp2_and_zero3():
    configs = [
        {"pipeline_parallel_degree": 2, "microbatches": 4},
        {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}},
    ]
    results = run_distributed(
        cases.train_ranks, 4, args=(list(cases.FAMILIES), configs, STEPS), timeout=600
    )
    _check(results, configs)


SLOW_GRID = [
    (2, [{"pipeline_parallel_degree": 2, "microbatches": 4}]),
    (
        4,
        [
            {"pipeline_parallel_degree": 4, "microbatches": 4},
            {"pipeline_parallel_degree": 2, "microbatches": 4, "virtual_stages": 2},
            {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 1}},
            {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 2}},
            {
                "pipeline_parallel_degree": 2,
                "microbatches": 2,
                "pipeline": "simple",
                "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
            },
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(1900)
@pytest.mark.parametrize(("world", "configs"), SLOW_GRID, ids=["pp2", "pp4-virtual-zero"])
def test_every_family_full_grid(world, configs):
    results = run_distributed(
        cases.train_ranks, world, args=(list(cases.FAMILIES), configs, STEPS), timeout=1800
    )
    _check(results, configs)
