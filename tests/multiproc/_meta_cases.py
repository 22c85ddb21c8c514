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


def pretrained_run(family: str, config: dict[str, Any], root: str, steps: int) -> dict[str, Any]:
    """Save ``family`` with save_pretrained into several shards (``root/src``), build it
    on meta, load it with load_pretrained, train ``steps`` steps, save to ``root/out``."""
    import mpar

    mpar.init(config)
    source = mpar.DistributedModel(hf.build(family))  # real, not partitioned: rank 0 writes
    mpar.save_pretrained(source, f"{root}/src", max_shard_size="20KB")
    model = mpar.DistributedModel(lambda: hf.build(family))
    mpar.load_pretrained(model, f"{root}/src")  # deferred to the first step
    opt = mpar.DistributedOptimizer(hf._optimizer(model.parameters()))

    @mpar.step
    def train_step(m: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = m(**inputs).loss
        m.backward(loss)
        return loss

    losses = []
    for s in range(steps):
        losses.append(float(train_step(model, _shard(hf.batch(family, s))).reduce_mean()))
        opt.step()
        opt.zero_grad()
    mpar.save_pretrained(model, f"{root}/out", max_shard_size="20KB")
    return {"losses": losses, "state": model.state_dict()}


def load_checks(root: str) -> dict[str, Any]:
    """load_pretrained on a meta GPT-2 at pp=2: errors before partitioning, a deferred
    bf16 load with a key mapping, then a load into the partitioned model."""
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = mpar.DistributedModel(lambda: hf.build("gpt2"))
    errors = {}
    for name in ("bad_shape", "missing", "extra"):
        try:
            mpar.load_pretrained(model, f"{root}/{name}")
        except KeyError as exc:
            errors[name] = str(exc)
    mpar.load_pretrained(model, f"{root}/missing", strict=False)  # keeps the init values
    mpar.load_pretrained(model, f"{root}/bf16", key_mapping={r"^old\.": ""})

    @mpar.step
    def forward(m: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(**inputs).loss

    forward(model, hf.batch("gpt2", 0))
    deferred = model.state_dict()
    mpar.load_pretrained(model, f"{root}/fp32")
    return {"errors": errors, "deferred": deferred, "after": model.state_dict()}
