"""What every engine in ``benchmarks/context_parallel.py`` shares: model, data, result.

The model is a GPT-style decoder whose attention is one call of
``scaled_dot_product_attention(q, k, v, is_causal=True)`` on [batch, heads, seq, dim]
tensors and whose positions come from a function it is given: every engine builds it
from the same seed and trains it with SGD on the same fixed batch of one long sequence
per sample. What differs is who splits the sequence and how attention sees all of it:

* mpar: the model as is (``mpar.context_parallel.position_ids`` for the positions);
  mpar replaces its attention call with the ring or the all-to-all operators;
* DeepSpeed Ulysses: each rank feeds its contiguous ``1/cp`` of every sequence (global
  positions), the attention call wrapped in ``deepspeed.sequence.layer.
  DistributedAttention``, the gradients summed over the sequence group and divided by
  cp (its losses are token means over equal shares);
* torch: ``torch.distributed.tensor.experimental.context_parallel`` around the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _harness import JsonCase
from torch import nn

__all__ = [
    "CPCase",
    "CPSpec",
    "CausalLM",
    "fixed_batch",
    "loss_fn",
    "make_model",
    "make_optimizer",
    "reference_losses",
    "step_peak",
]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(q, k, v)`` [batch, heads, seq, dim] -> the output, same shape as ``q``."""


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def arange_positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


@dataclass(frozen=True)
class CPSpec:
    """Sizes of the benchmark model and of one training step."""

    vocab: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 8
    seq: int = 4096
    batch: int = 1


@dataclass(frozen=True)
class CPCase(JsonCase):
    """One job: an engine training the model at ``cp`` on ``cp`` processes. ``lengths``
    set: no timing, one step at each length (longest-sequence search, ``cap`` bytes)."""

    MODEL = CPSpec

    framework: str
    """``mpar``, ``deepspeed`` (Ulysses) or ``torch`` (``context_parallel``)."""
    method: str
    """mpar's ``context_parallel_method`` (``ring`` / ``all_to_all``); the peers' own."""
    cp: int
    model: CPSpec
    warmup: int = 2
    steps: int = 4
    lengths: tuple[int, ...] = ()
    cap: int = 0


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attention: Attention) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = self.attention(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def sinusoid(positions: torch.Tensor, d: int) -> torch.Tensor:
    """Fixed sine/cosine position encodings [B, S, d] (no parameters: nothing of the
    positions' size lands in the gradients)."""
    freq = torch.exp(torch.arange(0, d, 2, device=positions.device) * (-math.log(1e4) / d))
    angle = positions.unsqueeze(-1).float() * freq
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class CausalLM(nn.Module):
    """Token embeddings + sine position encodings, pre-norm blocks, a final norm and an
    LM head."""

    def __init__(
        self,
        spec: CPSpec,
        attention: Attention = causal_sdpa,
        positions: Callable[[torch.Tensor], torch.Tensor] = arange_positions,
    ) -> None:
        super().__init__()
        d = spec.d_model
        self.positions = positions
        self.wte = nn.Embedding(spec.vocab, d)
        self.blocks = nn.ModuleList(
            Block(d, spec.num_heads, attention) for _ in range(spec.num_layers)
        )
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, spec.vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)
        x = x + sinusoid(self.positions(input_ids), x.shape[-1])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model(spec: CPSpec, **kwargs: Any) -> CausalLM:
    """The whole model, identical (same seed) in every process and engine."""
    torch.manual_seed(0)
    return CausalLM(spec, **kwargs)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy (targets aligned with the inputs: shifted in the data)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def fixed_batch(spec: CPSpec, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every step trains on: inputs and their next tokens."""
    g = torch.Generator().manual_seed(1234)
    seq = spec.seq if seq is None else seq
    tokens = torch.randint(0, spec.vocab, (spec.batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_losses(spec: CPSpec, steps: int) -> list[float]:
    """One process training the model on the whole sequence: its losses."""
    model = make_model(spec)
    opt = make_optimizer(model.parameters())
    x, y = fixed_batch(spec)
    out = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def step_peak(step: Callable[[], None], barrier: Callable[[], None]) -> int:
    """Peak RSS above the RSS right before one ``step`` (after a warm-up step at the same
    length), sampled every 2 ms; ``MALLOC_MMAP_THRESHOLD_=65536`` is set by the harness."""
    import gc

    from mpar.testing.rss import RssPeak

    step()
    gc.collect()
    barrier()
    with RssPeak() as rss:
        baseline = rss.reset()
        step()
        barrier()
    return rss.peak - baseline


def longest(
    case: CPCase,
    run_at: Callable[[int], Callable[[], None]],
    barrier: Callable[[], None],
    all_max: Callable[[int], int],
) -> list[dict[str, int]]:
    """One step at each of ``case.lengths`` in turn (``run_at(L)`` gives the step),
    each rank's peak above baseline (the maximum over ranks) until one exceeds
    ``case.cap``: the lengths tried and their peaks."""
    out = []
    for length in case.lengths:
        peak = all_max(step_peak(run_at(length), barrier))
        out.append({"seq": length, "peak_above_baseline_bytes": peak})
        if peak > case.cap:
            break
    return out


def tokens_per_s(spec: CPSpec, step_s: float) -> float:
    return spec.batch * spec.seq / step_s if step_s > 0 else math.nan
