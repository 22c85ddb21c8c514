"""Small, dependency-free models used by tests, benchmarks and examples.

``TinyGPT`` is the GPT pattern the partitioner recognises: a token embedding, a
position embedding, an ``nn.ModuleList`` of pre-norm transformer blocks, a final
norm and an LM head, optionally tied to the token embedding. ``TinyMoE`` is a language
model of mixture-of-experts blocks written as a user would (its own router, experts
per module or fused), which expert parallelism places through ``ep_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "GPT_TP_PLAN",
    "MOE_EP_PLAN",
    "Block",
    "ExpertMLP",
    "FusedExperts",
    "GPTConfig",
    "ListedExperts",
    "MoEBlock",
    "MoEConfig",
    "TinyGPT",
    "TinyMoE",
    "gpt_param_count",
]


@dataclass
class GPTConfig:
    """Sizes of a ``TinyGPT``."""

    vocab_size: int = 128
    d_model: int = 32
    num_layers: int = 4
    num_heads: int = 4
    d_ffn: int = 128
    max_seq_len: int = 64
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    """Dropout probability on each block's attention and MLP outputs (0: none)."""
    fused_qkv: bool = True
    """One ``qkv`` projection; false: separate ``q``, ``k``, ``v`` with heads taken from
    the tensor shape (the form tensor parallelism splits with a plain plan)."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.d_model // cfg.num_heads
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        else:
            self.q, self.k, self.v = (
                nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias) for _ in range(3)
            )
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ffn, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(cfg.d_ffn, cfg.d_model, bias=cfg.bias),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "qkv"):
            return self._forward_separate(x)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        shape = (b, t, self.num_heads, d // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln_2(x)))

    def _forward_separate(self, x: torch.Tensor) -> torch.Tensor:
        # Heads and sequence length come from the projections' outputs, never from ``x``:
        # tensor parallelism splits the heads and sequence parallelism the sequence of x.
        h = self.ln_1(x)
        q, k, v = (
            lin(h).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).flatten(2)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class TinyGPT(nn.Module):
    """GPT-style language model: ``forward(idx) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_param_count(cfg: GPTConfig) -> int:
    """The number of distinct parameters of ``TinyGPT(cfg)``, computed from the sizes."""
    d, f, bias = cfg.d_model, cfg.d_ffn, int(cfg.bias)
    norm = d * (1 + bias)
    block = 2 * norm + (3 * d * d + 3 * d * bias) + (d * d + d * bias)
    block += (d * f + f * bias) + (f * d + d * bias)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.max_seq_len * d + cfg.num_layers * block + norm + head


GPT_TP_PLAN = {
    "blocks.*.q": "colwise",
    "blocks.*.k": "colwise",
    "blocks.*.v": "colwise",
    "blocks.*.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
}
"""A tensor-parallel plan for ``TinyGPT`` built with ``fused_qkv=False`` (Megatron's split:
attention by heads, the MLP by hidden features)."""


# -- a mixture-of-experts model whose MoE block is the user's own ----------------------


@dataclass
class MoEConfig:
    """Sizes of a ``TinyMoE``."""

    vocab_size: int = 64
    d_model: int = 32
    num_layers: int = 2
    num_experts: int = 4
    top_k: int = 2
    d_expert: int = 48
    per_expert: bool = True
    """Experts as an ``nn.ModuleList`` of MLPs (true) or as fused ``[E, ...]`` weights."""


class ExpertMLP(nn.Module):
    """One expert: a GELU MLP on ``[n, d_model]`` rows."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_expert)
        self.fc2 = nn.Linear(cfg.d_expert, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class ListedExperts(nn.Module):
    """Experts held one module each; ``forward(x, top_k_index, top_k_weights)`` is the
    routing-weighted sum of each token's experts (every expert runs on every token, and
    zero weights drop it: simple, and a fixed-shape graph)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.experts = nn.ModuleList(ExpertMLP(cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            share = (weights * (index == e)).sum(dim=-1, keepdim=True)
            out = out + share * expert(x)
        return out


class FusedExperts(nn.Module):
    """Experts as stacked weights (the expert index first), the same contract."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.w_in = nn.Parameter(torch.randn(cfg.num_experts, cfg.d_expert, cfg.d_model) * 0.1)
        self.w_out = nn.Parameter(torch.randn(cfg.num_experts, cfg.d_model, cfg.d_expert) * 0.1)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            share = (weights * (index == e)).sum(dim=-1, keepdim=True)
            hidden = nn.functional.gelu(x @ self.w_in[e].t())
            out = out + share * (hidden @ self.w_out[e].t())
        return out


class MoEBlock(nn.Module):
    """Pre-norm residual mixture of experts; the router is a parameter of the block
    itself (no router module beside the experts: ``ep_plan`` names them)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.norm = nn.LayerNorm(cfg.d_model)
        self.route = nn.Parameter(torch.randn(cfg.num_experts, cfg.d_model) * 0.1)
        self.experts: nn.Module = ListedExperts(cfg) if cfg.per_expert else FusedExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x).reshape(b * t, d)
        probs = torch.softmax(h @ self.route.t(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return x + self.experts(h, index, weights).view(b, t, d)


class TinyMoE(nn.Module):
    """Language model of ``MoEBlock``s: ``forward(idx) -> logits``."""

    def __init__(self, cfg: MoEConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or MoEConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


MOE_EP_PLAN = {"blocks.*.experts": "experts"}
"""``TinyMoE``'s expert-parallel plan (its router is no module mpar can recognise)."""
