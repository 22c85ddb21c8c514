"""Small, dependency-free models used by tests, benchmarks and examples.

``TinyGPT`` is the GPT pattern the partitioner recognises: a token embedding, a
position embedding, an ``nn.ModuleList`` of pre-norm transformer blocks, a final
norm and an LM head, optionally tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GPT_TP_PLAN", "Block", "GPTConfig", "TinyGPT", "gpt_param_count"]


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
