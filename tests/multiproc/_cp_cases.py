"""Models, data and rank bodies of the context-parallelism tests.

The oracle: the same model trained in one process on the whole sequence of the whole
batch with plain torch (SGD, so that float noise stays float noise). Each rank body
returns its losses, its parameters' gradients after every step (before the optimizer
steps) and the gathered parameters at the end.

Models: Hugging Face Llama, Qwen2 and Mistral built from small configs with the
library's defaults (the loss computed inside the model from ``labels``), and a plain
GPT calling ``scaled_dot_product_attention`` whose positions come from
``mpar.context_parallel.position_ids`` (a model that numbers its tokens itself) and
whose loss the step function computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mpar.testing.rss import RssPeak

FAMILIES = ("llama", "qwen2", "mistral", "gpt")
BATCH = 4
SEQ = 16
VOCAB = 64
LR = 0.5


def build(family: str, *, layers: int = 2, hidden: int = 32, heads: int = 4) -> nn.Module:
    """The family's model, seeded so every process builds the same weights."""
    import transformers as hf

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,  # grouped-query attention
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        use_cache=False,  # as mpar runs it; Hugging Face reads packed documents only then
    )
    if family == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**sizes))
    if family == "qwen2":
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(**sizes))
    if family == "mistral":  # a window shorter than the sequence: it masks
        return hf.MistralForCausalLM(hf.MistralConfig(**sizes, sliding_window=6))
    if family == "gpt":
        return PlainGPT(hidden, heads, layers)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


class PlainBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class PlainGPT(nn.Module):
    """A GPT that numbers its tokens itself, as many hand-written models do; under
    context parallelism ``mpar.context_parallel.position_ids`` gives the global numbers."""

    def __init__(self, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(4096, d)
        self.blocks = nn.ModuleList(PlainBlock(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import mpar.context_parallel

        x = self.wte(input_ids)
        x = x + self.wpe(mpar.context_parallel.position_ids(input_ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(family: str, step: int, *, seq: int = SEQ, kind: str = "plain") -> dict[str, Any]:
    """The global batch of ``step``. ``kind``: ``"plain"``; ``"packed"`` (documents of
    uneven lengths packed into each row, ``position_ids`` restarting per document);
    ``"padded"`` (rows right-padded, ``attention_mask`` 0 and labels -100 there)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=g)
    out: dict[str, Any] = {"input_ids": ids[:, :-1].clone()}
    labels = ids[:, :-1].clone() if family != "gpt" else ids[:, 1:].clone()
    if kind == "packed":
        out["position_ids"] = _packed_positions(seq, g)
    if kind == "padded":
        mask = torch.ones(BATCH, seq, dtype=torch.long)
        for row, keep in enumerate(torch.randint(seq // 2, seq, (BATCH,), generator=g)):
            mask[row, keep:] = 0
        labels = labels.masked_fill(mask == 0, -100)
        out["attention_mask"] = mask
    out["labels"] = labels
    return out


def _packed_positions(seq: int, g: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(BATCH):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[:3].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def loss_of(family: str, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """(loss, logits): Hugging Face computes its loss from ``labels``; the plain GPT's
    is the token-mean cross-entropy over the labels that are not -100."""
    if family == "gpt":
        logits = model(inputs["input_ids"])
        labels = inputs["labels"]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss, logits
    out = model(**inputs)
    return out.loss, out.logits


def reference(family: str, steps: int, *, seq: int = SEQ, kind: str = "plain") -> dict[str, Any]:
    """One process, the whole batch, plain torch."""
    net = build(family)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, grads, logits = [], [], []
    for s in range(steps):
        loss, out = loss_of(family, net, batch(family, s, seq=seq, kind=kind))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        logits.append(out.detach())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state, "logits": logits}


def train(
    config: dict[str, Any],
    family: str,
    steps: int,
    *,
    seq: int = SEQ,
    kind: str = "plain",
    logits: bool = False,
) -> dict[str, Any]:
    """Rank body: ``mpar.init(config)``, then train on this replica's shard of each batch."""
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(build(family))
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @mpar.step
    def train_step(m: Any, inputs: dict[str, Any]) -> Any:
        loss, out = loss_of(family, m, inputs)
        m.backward(loss)
        return {"loss": loss, "logits": out} if logits else loss

    dp, rank = mpar.dp_size(), mpar.dp_rank()
    shard = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    losses, grads, outs = [], [], []
    for s in range(steps):
        inputs = {k: v[shard] for k, v in batch(family, s, seq=seq, kind=kind).items()}
        result = train_step(model, inputs)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        if logits:
            outs.append(result["logits"].concat())
            result = result["loss"]
        losses.append(float(result.reduce_mean()))
    out = {
        "losses": losses,
        "grads": grads,
        "state": model.state_dict(),
        "logits": outs,
        "cp": (mpar.cp_rank(), mpar.cp_size()),
        "microbatches": model.config.microbatches,
        "tp_shards": {} if model.tp_layout is None else dict(model.tp_layout.shards),
        "tp_rank": mpar.tp_rank(),
    }
    mpar.shutdown()
    return out


def train_each(jobs: list[tuple[dict[str, Any], str, str]], steps: int) -> list[dict[str, Any]]:
    """Rank body: :func:`train` each ``(config, family, kind)`` in turn (one set of
    processes, ``mpar.init`` and ``shutdown`` around each; the logits gathered)."""
    return [train(c, f, steps, kind=k, logits=True) for c, f, k in jobs]


TOL = {"rtol": 1e-4, "atol": 2e-5}


def check(results: list[dict[str, Any]], ref: dict[str, Any], tol: dict[str, float] = TOL) -> None:
    """Every rank's losses, gradients (its TP piece) and final parameters are the
    reference's."""
    from torch.testing import assert_close

    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **tol)
        for key, value in ref["state"].items():
            assert_close(r["state"][key], value, **tol, msg=lambda m, k=key: f"{k}: {m}")
        for step, grads in enumerate(r["grads"]):
            for name, grad in grads.items():
                want = ref["grads"][step][name]
                shard = r["tp_shards"].get(name)
                if shard is not None:
                    want = shard.local(want, r["tp_rank"])
                assert_close(grad, want, **tol, msg=lambda m, n=name, s=step: f"{s} {n}: {m}")
        for step, out in enumerate(r["logits"]):
            want = ref["logits"][step]
            if out.shape[-1] != want.shape[-1]:  # split on the vocabulary by TP's LM head:
                want = want[..., : out.shape[-1]]  # a step returns TP rank 0's piece
            assert_close(out, want, **tol)
        assert all(math.isfinite(x) for x in r["losses"])


def _small_mmap_threshold() -> None:
    """``MALLOC_MMAP_THRESHOLD_=65536`` for this (already started) process: tensors above
    64 KiB are mapped on their own and leave the RSS as soon as they are freed."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD


def peak_memory(config: dict[str, Any], seq: int, steps: int = 2) -> dict[str, int]:
    """Rank body: this rank's peak RSS above the RSS before the timed steps while a
    Llama with a long sequence trains (after one warm-up step), and mpar's count of the
    activation bytes kept for backward."""
    import mpar

    _small_mmap_threshold()
    mpar.init(config)
    model = mpar.DistributedModel(build("llama", layers=4, hidden=64, heads=4))
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @mpar.step
    def train_step(m: Any, inputs: dict[str, Any]) -> torch.Tensor:
        loss = m(**inputs).loss
        m.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    inputs = {"input_ids": ids, "labels": ids}

    def one() -> None:
        train_step(model, inputs)
        opt.step()
        opt.zero_grad()

    one()
    import gc

    gc.collect()
    mpar.barrier()
    with RssPeak() as rss:
        for _ in range(steps):
            one()
    report = mpar.memory_report()
    mpar.barrier()
    return {
        "peak_above_baseline": rss.peak - rss.baseline,
        "activations": sum(row["activations"] for row in report.values()),
    }


def resume(
    config: dict[str, Any], root: str, steps: list[int], *, load: bool, save_after: int = -1
) -> dict[str, Any]:
    """Rank body: Llama with SGD + momentum (optimizer state to carry); load ``root``
    first if ``load``; train ``steps``, saving a checkpoint after step ``save_after``."""
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(build("llama"))
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))

    @mpar.step
    def train_step(m: Any, inputs: dict[str, Any]) -> torch.Tensor:
        loss = m(**inputs).loss
        m.backward(loss)
        return loss

    if load:
        mpar.load_checkpoint(root, model, opt)
    mpar.barrier()  # every rank has read the checkpoint before any writes one
    dp, rank = mpar.dp_size(), mpar.dp_rank()
    shard = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    losses = []
    for s in steps:
        inputs = {k: v[shard] for k, v in batch("llama", s).items()}
        losses.append(float(train_step(model, inputs).reduce_mean()))
        opt.step()
        opt.zero_grad()
        if s == save_after:
            mpar.save_checkpoint(root, model, opt)
    out = {"losses": losses, "state": model.state_dict()}
    mpar.shutdown()
    return out


def resume_each(root: str, runs: list[tuple[dict[str, Any], list[int], bool, int]]) -> list[Any]:
    """Rank body: :func:`resume` each ``(config, steps, load, save_after)`` in turn."""
    return [resume(c, root, steps, load=load, save_after=at) for c, steps, load, at in runs]
