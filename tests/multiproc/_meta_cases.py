"""Rank bodies for the meta-construction, load_pretrained and save_pretrained tests."""

from __future__ import annotations

from typing import Any

import torch

from tests.multiproc import _hf_cases as hf


def _shard(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import mpar

    dp, rank = mpar.dp_size(), mpar.dp_rank()
    part = slice(rank * hf.BATCH // dp, (rank + 1) * hf.BATCH // dp)
    return {k: v[part] for k, v in inputs.items()}


def meta_state(families: list[str], config: dict[str, Any]) -> dict[str, Any]:
    """Each family built by a factory on meta and partitioned by a forward step: the
    gathered state, and how many local tensors hold NaN."""
    import mpar

    mpar.init(config)
    out: dict[str, Any] = {}
    for family in families:
        model = mpar.DistributedModel(lambda family=family: hf.build(family))

        @mpar.step
        def forward(m: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return m(**inputs).loss

        forward(model, _shard(hf.batch(family, 0)))
        local = [
            *model.local_parameters(),
            *(b for s in model.stages.modules.values() for b in s.buffers()),
        ]
        nan = sum(1 for t in local if t.is_floating_point() and bool(t.isnan().any()))
        out[family] = {"state": model.state_dict(), "nan": nan}
    return out
