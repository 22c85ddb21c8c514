"""What every framework in ``benchmarks/pipeline.py`` shares: model, data, split, timing.

The model is one list of layers — a token+position embedding, ``num_layers``
pre-norm transformer blocks (``mpar.testing.models.Block``), a final norm with
the LM head — that mpar (as an ``nn.Sequential``), torch.distributed.pipelining
(``PipelineStage``s of slices of it) and DeepSpeed (``PipelineModule(layers=...)``)
all take unchanged. Every framework builds it from the same seed, trains it on
the same fixed batch with the same microbatches and SGD, and is timed the same
way (:func:`time_steps`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _harness import JsonCase
from torch import nn

from mpar.testing.models import Block, GPTConfig

__all__ = [
    "package_version",
    "Case",
    "Embedding",
    "Head",
    "ModelSpec",
    "global_batch",
    "loss_fn",
    "make_layers",
    "make_optimizer",
    "set_threads",
    "stage_slices",
    "time_steps",
    "uniform_boundaries",
]


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the benchmark model and of one training step."""

    vocab: int = 1024
    d_model: int = 128
    num_layers: int = 8
    num_heads: int = 4
    seq: int = 64
    batch: int = 32
    """Global batch (all data-parallel replicas together)."""
    microbatches: int = 8

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_ffn=4 * self.d_model,
            max_seq_len=self.seq,
            tie_embeddings=False,
        )


BACKEND = "+backend"
"""Suffix of an mpar schedule run with ``shared_memory: false``: its pipeline transfers
go through gloo like the peers', for a side-by-side with the default."""

MEASURED = "zero_bubble+measured"
"""mpar's zero_bubble with ``active_microbatches`` one above what ZB-H1 holds (at most
the microbatches): the runtime times steps 3 to 5, places W from those times and keeps
the placement only if steps 7 to 12, alternating it with ZB-H1's order, show it faster
(the row warms up for at least 12 steps)."""


@dataclass(frozen=True)
class Case(JsonCase):
    """One run: a framework and schedule on a pp x dp layout, timed for ``steps`` steps."""

    MODEL = ModelSpec

    framework: str
    """``mpar``, ``torch`` (torch.distributed.pipelining) or ``deepspeed``."""
    schedule: str
    """The framework's own name for the schedule (``interleaved``, ``Schedule1F1B``, ...)."""
    pp: int
    dp: int
    virtual_stages: int
    model: ModelSpec
    warmup: int = 3
    steps: int = 10
    split: str = "uniform"
    """``uniform`` (equal layer counts, DeepSpeed's method, for every framework) or
    ``auto`` (mpar's profile-driven partition; mpar only)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(batch, seq)`` ids -> activations."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    """Final layer norm and LM head: activations -> logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def make_layers(spec: ModelSpec) -> list[nn.Module]:
    """The model as a list of layers, identical (same seed) in every process."""
    torch.manual_seed(0)
    cfg = spec.gpt_config()
    return [Embedding(cfg), *(Block(cfg) for _ in range(spec.num_layers)), Head(cfg)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy of one microbatch."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def global_batch(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed global batch every step trains on: inputs and next-token targets."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def uniform_boundaries(num_items: int, num_parts: int) -> list[int]:
    """Equal layer counts, earlier parts taking the remainder (DeepSpeed's ``uniform``).

    Returns ``num_parts + 1`` offsets: part ``p`` is ``items[b[p]:b[p + 1]]``.
    """
    if num_parts > num_items:
        raise ValueError(f"cannot split {num_items} layers into {num_parts} non-empty stages")
    size, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + size + (1 if p < extra else 0))
    return bounds


def stage_slices(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``(start, stop)`` layer indices of each stage of the uniform split."""
    b = uniform_boundaries(num_layers, num_stages)
    return [(b[s], b[s + 1]) for s in range(num_stages)]


def set_threads() -> int:
    """One intra-op thread count for every rank of every framework (``OMP_NUM_THREADS``)."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    return threads


def time_steps(
    step: Callable[[], None], barrier: Callable[[], None], warmup: int, steps: int
) -> dict[str, Any]:
    """Run ``warmup`` untimed steps, then time ``steps`` steps between two barriers,
    sampling this rank's RSS (``_harness.measured_steps``)."""
    from _harness import measured_steps

    return measured_steps(step, barrier, warmup, steps)


def package_version(distribution: str) -> str:
    """The installed version of ``distribution`` (a peer's), or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"
