"""Rank bodies for the meta-construction, load_pretrained and save_pretrained tests."""

from __future__ import annotations

import dataclasses
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


def profile_budget(device_memory: int | None) -> dict[str, Any]:
    """A real TinyGPT partitioned at construction (pp=2) under ``device_memory``: how
    many times rank 0 ran a block on real tensors while partitioning, and the loss
    of one step."""
    from torch._subclasses.fake_tensor import FakeTensor

    import mpar
    import mpar.partition
    from mpar.testing.models import GPTConfig, TinyGPT

    # The planner counts ~84 MiB of per-process overhead against device_memory, so a
    # model whose weights exceed the budget would need > 120 MiB to be plannable;
    # the budget here only decides how rank 0 profiles, the plan ignores it.
    make_plan = mpar.partition.make_plan
    mpar.partition.make_plan = lambda profile, inputs, **k: make_plan(
        profile, dataclasses.replace(inputs, device_memory=None), **k
    )
    config: dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": 2}
    if device_memory is not None:
        config["device_memory"] = device_memory
    mpar.init(config)
    torch.manual_seed(0)
    net = TinyGPT(GPTConfig(num_layers=4))
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    real_runs = [0]

    def count(module: Any, args: tuple[Any, ...]) -> None:
        if any(isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) for a in args):
            real_runs[0] += 1

    hooks = [block.register_forward_pre_hook(count) for block in net.blocks]
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    model = mpar.DistributedModel(net, example_inputs=(idx[:2],))
    runs = real_runs[0]
    for hook in hooks:
        hook.remove()

    @mpar.step
    def forward(m: Any, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())

    loss = float(forward(model, idx).reduce_mean())
    return {"real_runs": runs, "loss": loss, "weights": weights}


class MaskedAttention(torch.nn.Module):
    """Causal self-attention whose mask is a bool buffer computed in ``__init__`` (no
    initialiser recomputes it: on the meta device its value is lost)."""

    def __init__(self, d: int = 16, seq: int = 16) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        att = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return x + self.out(att @ v)


def masked_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(32, 16), MaskedAttention(), MaskedAttention(), torch.nn.Linear(16, 32)
    )


def set_mask(module: torch.nn.Module) -> None:
    """The ``init_fn`` that recomputes the masks (the fix the error names)."""
    if isinstance(module, MaskedAttention):
        n = module.mask.shape[0]
        module.mask.copy_(torch.tril(torch.ones(n, n, dtype=torch.bool)))


def masked_run(with_init_fn: bool) -> dict[str, Any]:
    """The masked model built on meta at pp=2: one training step's loss and the gathered
    state."""
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    init_fn = set_mask if with_init_fn else None
    model = mpar.DistributedModel(masked_model, init_fn=init_fn)

    @mpar.step
    def train(m: Any, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        m.backward(loss)
        return loss

    loss = float(train(model, masked_batch()).reduce_mean())
    return {"loss": loss, "state": model.state_dict()}


def masked_batch() -> torch.Tensor:
    return torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(3))
