"""Models, data and rank bodies shared by the pipeline runtime tests.

The oracle: the same model trained in one process on the whole (global) batch
with plain torch. Every rank body returns what it saw so the test process can
compare losses, outputs, gradients and parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mpar

BATCH = 12  # global batch per step (split over data-parallel replicas, then microbatches)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    )


def tiny_gpt() -> nn.Module:
    from mpar.testing.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, d_model=16, num_layers=4, num_heads=2, d_ffn=32, max_seq_len=8)
    return TinyGPT(cfg)


def tp_gpt() -> nn.Module:
    """TinyGPT with separate q/k/v (split by ``mpar.testing.models.GPT_TP_PLAN``), 4 heads."""
    from mpar.testing.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=32,
        d_model=16,
        num_layers=4,
        num_heads=4,
        d_ffn=32,
        max_seq_len=8,
        fused_qkv=False,
    )
    return TinyGPT(cfg)


MODELS = {"mlp": mlp, "gpt": tiny_gpt, "tp_gpt": tp_gpt}


def batch(model: str, step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if model in ("gpt", "tp_gpt"):
        tokens = torch.randint(0, 32, (size, 9), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out[0]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@mpar.step
def train_loss(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A training step on :func:`loss_fn` returning the loss: what most runtime and
    fault tests run (the rank bodies call it on their ``DistributedModel``)."""
    loss = loss_fn(m(x), y)
    m.backward(loss)
    return loss


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # A larger eps keeps Adam from turning float noise on near-zero gradients
    # into lr-sized steps (see DESIGN.md, correctness oracle).
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.01)


def start_training(
    config: dict[str, Any], optimizer: Callable[[Any], torch.optim.Optimizer]
) -> tuple[Any, Any, Callable[..., Any]]:
    """Rank body set-up: ``mpar.init(config)``, the MLP as a DistributedModel,
    ``optimizer(parameters)`` behind a DistributedOptimizer, and a ``@mpar.step``
    function ``train(model, x, y)`` that backpropagates the loss and returns it."""
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(optimizer(model.parameters()))

    @mpar.step
    def train(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    return model, opt, train


def reference(
    model: str, optimizer: str, steps: int, clip: float | None = None, batch_size: int = BATCH
) -> dict[str, Any]:
    net = MODELS[model]()
    opt = make_optimizer(optimizer, net.parameters())
    losses, grads, outputs = [], [], []
    for s in range(steps):
        x, y = batch(model, s, batch_size)
        out = net(x)
        loss = loss_fn(out, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        outputs.append(out.detach() if isinstance(out, torch.Tensor) else out[0].detach())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "state": state, "grads": grads, "outputs": outputs}


def train_ranks(
    config: dict[str, Any],
    model: str,
    optimizer: str,
    steps: int,
    clip: float | None = None,
    batch_size: int = BATCH,
) -> dict[str, Any]:
    """Rank body: train with mpar on this replica's shard of each global batch
    (``batch_size`` samples, ``BATCH`` unless more microbatches need more)."""
    import mpar

    mpar.init(config)
    dmodel = mpar.DistributedModel(MODELS[model]())
    opt = mpar.DistributedOptimizer(make_optimizer(optimizer, dmodel.parameters()))

    @mpar.step
    def train_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = m(x)
        loss = loss_fn(out, y)
        m.backward(loss)
        logits = out if isinstance(out, torch.Tensor) else out[0]
        return {"loss": loss, "logits": logits}

    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    losses, grads, outputs = [], [], []
    for s in range(steps):
        x, y = batch(model, s, batch_size)
        shard = slice(dp_rank * batch_size // dp, (dp_rank + 1) * batch_size // dp)
        result = train_step(dmodel, x[shard], y[shard])
        if clip is not None:
            opt.clip_grad_norm_(clip)
        grads.append(
            {n: p.grad.clone() for n, p in dmodel.named_parameters() if p.grad is not None}
        )
        opt.step()
        opt.zero_grad()
        losses.append(float(result["loss"].reduce_mean()))
        outputs.append(result["logits"].concat())
    return {
        "losses": losses,
        "loss_scale": opt.loss_scale,
        "state": dmodel.state_dict(),
        "grads": grads,
        "outputs": outputs,
        "pp": (mpar.pp_rank(), mpar.pp_size()),
        "dp": (dp_rank, dp),
        "schedule": dmodel.schedule(forward_only=False),  # the training schedule run last
        "placement_costs": dmodel.placement.costs,  # zero_bubble placed from measured times
        "placement_kept": dmodel.placement.kept,  # and whether it ran faster than ZB-H1
        "placement_ratios": dmodel.placement.ratios,  # placed / ZB-H1 step, per pair
        "param_devices": sorted({p.device.type for p in dmodel.local_parameters()}),
        "tp": (mpar.tp_rank(), mpar.tp_size()),
        "tp_shards": {} if dmodel.tp_layout is None else dict(dmodel.tp_layout.shards),
        "sequence_parallel": dmodel.tp_layout is not None and dmodel.tp_layout.sequence is not None,
        "param_bytes": sum(p.numel() * p.element_size() for p in dmodel.local_parameters()),
        "param_storage_bytes": _host_storage_bytes(dmodel.local_parameters()),
        "report_param_bytes": mpar.memory_report().get("cpu", {}).get("parameters"),
        "memory_devices": sorted(mpar.memory_report()),
        "config": dmodel.config,
    }


def _host_storage_bytes(params: list[nn.Parameter]) -> int | None:
    """Bytes of the distinct storages holding ``params`` (None off the host, where a
    storage's address is not the tensor's to read)."""
    if any(p.device.type != "cpu" for p in params):
        return None
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    return sum(storages.values())


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=4,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def hf_reference(steps: int) -> dict[str, Any]:
    net = hf_gpt2()
    opt = make_optimizer("adamw", net.parameters())
    losses = []
    for s in range(steps):
        x, y = batch("gpt", s)
        logits = net(input_ids=x).logits
        loss = loss_fn(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()}}


def hf_train_ranks(config: dict[str, Any], steps: int) -> dict[str, Any]:
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(hf_gpt2())
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))

    @mpar.step
    def train_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(input_ids=x).logits, y)
        m.backward(loss)
        return loss

    losses = []
    dp, dp_rank = mpar.dp_size(), mpar.dp_rank()
    for s in range(steps):
        x, y = batch("gpt", s)
        shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        losses.append(float(train_step(model, x[shard], y[shard]).reduce_mean()))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": model.state_dict(), "plan": str(model.plan)}


def _pieces(
    x: torch.Tensor, y: torch.Tensor, dp: int, m: int
) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """``(x, y, share)`` of each replica's microbatches, as mpar splits a batch; the
    share is what mpar multiplies the microbatch's loss by (its size over the replica's,
    over ``dp``)."""
    out = []
    for r in range(dp):
        shard = slice(r * len(x) // dp, (r + 1) * len(x) // dp)
        size = shard.stop - shard.start
        for xc, yc in zip(x[shard].tensor_split(m), y[shard].tensor_split(m)):
            out.append((xc, yc, len(xc) / size / dp))
    return out


def mixed_reference(
    model: str,
    optimizer: str,
    steps: int,
    dtype: torch.dtype,
    clip: float | None = None,
    *,
    split: tuple[int, int] = (1, 1),
    accumulate: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """One process, whole batch, mpar's mixed-precision recipe written out in plain torch.

    The module computes in ``dtype`` (parameters and buffers converted), float
    inputs are cast to it, the output is cast back to float32 for the loss;
    the optimizer updates float32 master copies from the float32-converted
    gradients and the module gets the rounded values back. fp16 multiplies the
    loss by 2**16 (mpar's initial dynamic scale) and divides it out again; a
    step with an inf or NaN gradient is skipped and the scale halves.

    ``split=(dp, m)`` cuts each batch as mpar does: ``dp`` replicas' consecutive shards,
    each in ``m`` microbatches (``torch.tensor_split``), each with its own backward of
    its loss times its share of the batch; their ``dtype`` gradients are summed in
    ``accumulate`` (float32: mpar's default ``grad_reduce_dtype``; ``dtype``: the
    low-precision setting).
    """
    net = MODELS[model]()
    named = list(net.named_parameters())
    masters = [nn.Parameter(p.detach().clone()) for _, p in named]
    net.to(dtype)
    opt = make_optimizer(optimizer, masters)
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    losses, outputs, skipped = [], [], 0
    for s in range(steps):
        x, y = batch(model, s)
        sums: list[torch.Tensor | None] = [None] * len(named)
        step_losses, step_logits = [], []
        for xc, yc, share in _pieces(x, y, *split):
            out = net(xc.to(dtype) if xc.is_floating_point() else xc)
            logits = (out if isinstance(out, torch.Tensor) else out[0]).float()
            loss = loss_fn(logits, yc)
            (loss * share * scale if share != 1.0 else loss * scale).backward()
            for i, (_, p) in enumerate(named):
                if p.grad is not None:
                    g = p.grad.to(accumulate)
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
                p.grad = None
            step_losses.append(loss.item() * share)
            step_logits.append(logits.detach())
        for master, total in zip(masters, sums):
            master.grad = None if total is None else total.float() * (1.0 / scale)
        losses.append(sum(step_losses))
        outputs.append(torch.cat(step_logits))
        if not all(m.grad is None or bool(torch.isfinite(m.grad).all()) for m in masters):
            scale /= 2  # fp16 overflow: skip the step, lower the scale
            skipped += 1
            opt.zero_grad()
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, (_, p) in zip(masters, named):
                p.copy_(master)
    by_id = {id(p): m for m, (_, p) in zip(masters, named)}
    state = {}
    for key, tensor in net.state_dict(keep_vars=True).items():
        state[key] = by_id[id(tensor)].detach().clone() if id(tensor) in by_id else tensor.float()
    return {"losses": losses, "state": state, "outputs": outputs, "skipped": skipped}
