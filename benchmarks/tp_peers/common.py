"""What every engine in ``benchmarks/tensor_parallel.py`` shares: model, data, optimizer, result.

The model is ``mpar.testing.models.TinyGPT`` with separate ``q``/``k``/``v``
projections (``fused_qkv=False``), whose attention takes its head count from the
tensor shape (``view(b, t, -1, head_dim)``), so column-splitting q/k/v by heads
needs no change to the module. Every engine builds it from the same seed, splits
the same six Linear layers per block (Megatron's split: q, k, v and ``mlp.0``
by output features, ``proj`` and ``mlp.2`` by input features; embeddings, norms
and the LM head replicated), and trains it with torch's AdamW on the same fixed
batch, which every tensor-parallel rank sees whole (dp = 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from _harness import JsonCase
from torch import nn

from mpar.testing.models import GPTConfig, TinyGPT

__all__ = [
    "SPLIT",
    "TPCase",
    "TPSpec",
    "global_batch",
    "local_bytes",
    "loss_fn",
    "make_model",
    "make_optimizer",
    "expected_local_parameters",
    "result",
]

SPLIT = {"q": "colwise", "k": "colwise", "v": "colwise", "proj": "rowwise"}
SPLIT |= {"mlp.0": "colwise", "mlp.2": "rowwise"}
"""The split Linear layers of every block, by name under ``blocks.N`` (mpar's
``GPT_TP_PLAN``, spelled out per block for the peers)."""


@dataclass(frozen=True)
class TPSpec:
    """Sizes of the benchmark model and of one training step."""

    vocab: int = 1024
    d_model: int = 256
    num_layers: int = 6
    num_heads: int = 8
    seq: int = 128
    batch: int = 8

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_ffn=4 * self.d_model,
            max_seq_len=self.seq,
            tie_embeddings=False,
            fused_qkv=False,
        )


@dataclass(frozen=True)
class TPCase(JsonCase):
    """One job: an engine training the model at ``tp`` on ``tp`` processes."""

    MODEL = TPSpec

    framework: str
    """``mpar``, ``torch`` (DTensor ``parallelize_module``) or ``deepspeed`` (AutoTP)."""
    tp: int
    model: TPSpec
    warmup: int = 2
    steps: int = 5


def make_model(spec: TPSpec) -> TinyGPT:
    """The whole model, identical (same seed) in every process and engine."""
    torch.manual_seed(0)
    return TinyGPT(spec.gpt_config())


def expected_local_parameters(spec: TPSpec, tp: int) -> int:
    """This rank's parameter count at ``tp``: the replicated parameters whole, the split
    ones (q, k, v, ``mlp.0`` with their biases; ``proj``, ``mlp.2`` weights) by ``tp``."""
    from mpar.testing.models import gpt_param_count

    d, f = spec.d_model, 4 * spec.d_model
    split = 3 * (d * d + d) + (d * f + f) + d * d + f * d
    total = gpt_param_count(spec.gpt_config())
    return total - spec.num_layers * split + spec.num_layers * split // tp


def make_optimizer(params: Iterable[Any]) -> torch.optim.Optimizer:
    """torch's AdamW for every engine (``foreach=False``: the same kernels for plain
    tensors and DTensors)."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(spec: TPSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch every step trains on: inputs and next-token targets."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's pieces (a DTensor's local shard, a plain tensor whole)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def result(
    timing: dict[str, Any],
    losses: list[float],
    memory: dict[str, int],
    all_gather_object: Callable[[list[Any], Any], None],
    world: int,
    **extra: Any,
) -> dict[str, Any]:
    """Rank 0's result: timing, the warm-up losses and every rank's state bytes. Collective."""
    memories: list[Any] = [None] * world
    all_gather_object(memories, memory)
    return {
        **timing,
        "threads": torch.get_num_threads(),
        "warmup_losses": losses,
        "state_per_rank": memories,
        "world": world,
        "pid_env_rank": int(os.environ.get("RANK", "0")),
        **extra,
    }
