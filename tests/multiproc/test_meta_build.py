"""A model built on the meta device gets the same values in every layout.

``DistributedModel(factory)`` builds the model under ``torch.device("meta")``,
partitions it from a FLOPs profile and materializes only this rank's share; the
gathered state dict must equal ``mpar.materialize`` of the same model in one
process, bit for bit, whatever the pipeline, data-parallel, ZeRO and
virtual-stage layout. Fresh storage is filled with NaN before initialisation, so
a tensor no initialiser set would show here (and raises at build time).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpar
from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc import _hf_cases as hf
from tests.multiproc import _meta_cases as cases

pytest.importorskip("transformers")


def _expected(family: str, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = hf.build(family)
    return mpar.materialize(model, seed=seed).state_dict()


def _check(results: list[dict[str, Any]], families: list[str], seed: int, where: str) -> None:
    for family in families:
        want = _expected(family, seed)
        for rank, result in enumerate(results):
            got = result[family]
            assert got["nan"] == 0, f"{family} {where} rank {rank}: NaN in local tensors"
            assert list(got["state"]) == list(want)
            for key, value in want.items():
                assert torch.equal(got["state"][key], value), f"{family} {where}: {key}"


DEFAULT = [
    (4, ["llama"], {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}}),
    (2, ["gpt2"], {"microbatches": 2, "seed": 7}),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,families,config", DEFAULT, ids=["pp2-dp2-zero3", "pp1-dp2-seed7"])
def test_meta_build_matches_materialize(world, families, config):
    results = run_distributed(cases.meta_state, world, args=(families, config), timeout=280)
    _check(results, families, config.get("seed", 0), str(config))


def _grid() -> list[tuple[int, dict[str, Any]]]:
    out = []
    for pp in (1, 2, 4):
        for dp in (1, 2):
            for zero in (0, 3):
                for virtual in (1, 2):
                    if pp == 1 and virtual == 2:
                        continue  # one stage per rank: no virtual stages
                    cfg: dict[str, Any] = {
                        "pipeline_parallel_degree": pp,
                        "microbatches": pp * (3 - dp),  # a replica gets 8 / dp samples
                        "virtual_stages": virtual,
                        "zero": {"stage": zero},
                    }
                    if zero == 3 and pp == 2 and dp == 2:
                        cfg["zero"] |= {"offload_params": "cpu", "offload_optimizer": "cpu"}
                    out.append((pp * dp, cfg))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,config", _grid(), ids=lambda v: str(v).replace(" ", ""))
def test_meta_build_layout_grid(world, config):
    families = ["llama", "gpt2", "t5"]
    results = run_distributed(cases.meta_state, world, args=(families, config), timeout=880)
    _check(results, families, 0, str(config))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bool_mask_computed_in_init_is_named_at_pp2():
    # Before: the mask's storage stayed uninitialised bool bytes (half the entries
    # wrong; NaN loss at pp=2) and no error was raised. (In one process:
    # tests/unit/test_materialize.py, in the default suite.)
    named = r"InitError: [12]\.mask \(\(16, 16\), torch.bool\), a buffer .* init_fn="
    with pytest.raises(DistributedTestError, match=named):
        run_distributed(cases.masked_run, 2, args=(False,), timeout=100)


@pytest.mark.timeout(120)
def test_a_bool_mask_recomputed_by_init_fn_equals_the_eager_one_at_pp2():
    results = run_distributed(cases.masked_run, 2, args=(True,), timeout=100)
    eager = cases.masked_model()
    with torch.device("meta"):
        meta = cases.masked_model()
    reference = mpar.materialize(meta, init_fn=cases.set_mask)
    x = cases.masked_batch()
    out = reference(x)
    loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    for r in results:
        for key, value in reference.state_dict().items():
            assert torch.equal(r["state"][key], value), key
        assert torch.equal(r["state"]["1.mask"], eager.state_dict()["1.mask"])
        torch.testing.assert_close(r["loss"], float(loss.detach()), rtol=1e-5, atol=1e-6)
