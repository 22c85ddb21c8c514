"""What every engine in ``benchmarks/expert_parallel.py`` shares: model, data, bytes, result.

The model is a GPT-style language model of pre-norm blocks, each causal
self-attention then a mixture-of-experts feed-forward layer: ``num_experts`` GELU
MLPs (``d_model -> d_expert -> d_model``), ``top_k`` of them per token, routed by
a bias-free linear router on the softmax, the top-k weights renormalised (Mixtral's
routing). The experts are most of the parameters, as in the MoE models people train.
Every engine builds the same blocks from the same seed; only the MoE layer differs:

* mpar: :class:`MoELayer`, a router ``nn.Linear(d, E)`` beside :class:`SparseExperts`
  (an ``nn.ModuleList`` of experts, each run on its tokens only): expert parallelism
  finds it by structure;
* DeepSpeed: ``deepspeed.moe.layer.MoE`` with the same expert module, ``k = top_k``,
  dropless (``drop_tokens=False``), no random token selection.

Each rank trains on its own fixed batch (``dp = world``), the loss the mean token
cross-entropy (DeepSpeed's balance loss is left out of the loss; mpar's model has
none).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from _harness import JsonCase
from torch import nn

__all__ = [
    "EPCase",
    "EPSpec",
    "ExpertMLP",
    "MoEGPT",
    "MoELayer",
    "SparseExperts",
    "a2a_formula",
    "local_batch",
    "loss_fn",
    "make_optimizer",
]


@dataclass(frozen=True)
class EPSpec:
    """Sizes of the benchmark model and of one training step (per rank)."""

    vocab: int = 1024
    d_model: int = 256
    d_expert: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    seq: int = 128
    batch: int = 8
    """Sequences per rank and step."""

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def expert_parameters(self) -> int:
        """Parameters of every expert of every layer (what ep = 1 holds)."""
        d, f = self.d_model, self.d_expert
        return self.num_layers * self.num_experts * (d * f + f + f * d + d)


@dataclass(frozen=True)
class EPCase(JsonCase):
    """One job: an engine training the model on ``world`` ranks."""

    MODEL = EPSpec

    framework: str
    """``mpar`` or ``deepspeed``."""
    world: int
    ep: int
    model: EPSpec
    zero: int = 3
    warmup: int = 2
    steps: int = 5

    @property
    def name(self) -> str:
        return f"{self.framework} ep={self.ep}" + (f" zero{self.zero}" if self.zero else "")


class ExpertMLP(nn.Module):
    """One expert: ``d_model -> d_expert -> d_model`` with GELU, on ``[n, d]`` rows."""

    def __init__(self, spec: EPSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.d_model, spec.d_expert)
        self.fc2 = nn.Linear(spec.d_expert, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class SparseExperts(nn.Module):
    """``forward(x [T, d], index [T, k], weights [T, k])``: each expert on its own rows."""

    def __init__(self, spec: EPSpec) -> None:
        super().__init__()
        self.experts = nn.ModuleList(ExpertMLP(spec) for _ in range(spec.num_experts))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = index.shape[-1]
        pairs = index.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = order[start : start + n] // k
                y = self.experts[e](x[rows]) * w[start : start + n].unsqueeze(-1)
                out = out.index_add(0, rows, y)
            start += n
        return out


class MoELayer(nn.Module):
    """Router beside the experts: softmax, top-k, the weights renormalised."""

    def __init__(self, spec: EPSpec) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.router = nn.Linear(spec.d_model, spec.num_experts, bias=False)
        self.experts = SparseExperts(spec)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        flat = h.reshape(b * t, d)
        probs = torch.softmax(self.router(flat), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).view(b, t, d)


class _Block(nn.Module):
    def __init__(self, spec: EPSpec, moe: nn.Module) -> None:
        super().__init__()
        self.heads = spec.num_heads
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out = self.moe(self.ln_2(x))
        out = out[0] if isinstance(out, tuple) else out  # DeepSpeed: (out, l_aux, counts)
        return x + out


class MoEGPT(nn.Module):
    """``forward(idx) -> logits``; ``moe_layer(spec)`` makes each block's MoE layer."""

    def __init__(self, spec: EPSpec, moe_layer: Any = MoELayer) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.d_model)
        self.pos = nn.Embedding(spec.seq, spec.d_model)
        self.blocks = nn.ModuleList(_Block(spec, moe_layer(spec)) for _ in range(spec.num_layers))
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_optimizer(params: Iterable[Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def local_batch(spec: EPSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch: inputs and next-token targets."""
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def a2a_formula(spec: EPSpec, ep: int, remote: float | None = None) -> float:
    """docs/expert_parallel.md: bytes one rank sends per training step, all MoE layers:
    ``(P_out + P_in)(2 H b + w)`` rows plus ``(ep - 1) E/ep 8`` counts per layer, with
    ``P_out = P_in = T k f`` (``f`` the fraction of pairs routed to other ranks:
    ``remote``, or ``(ep - 1) / ep`` for routing spread evenly)."""
    f = (ep - 1) / ep if remote is None else remote
    pairs = spec.tokens * spec.top_k * f
    rows = 2 * pairs * (2 * spec.d_model * 4 + 4)
    counts = (ep - 1) * (spec.num_experts // ep) * 8
    return spec.num_layers * (rows + counts)


def result(timing: dict[str, Any], losses: list[float], extra: dict[str, Any]) -> dict[str, Any]:
    return {"warmup_losses": losses, **timing, **extra}
