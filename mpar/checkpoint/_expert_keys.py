"""Per-expert checkpoint keys read into fused expert weights.

transformers 5 keeps a mixture-of-experts layer's experts fused (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj [E, H, I]``) but reads and writes checkpoints in the
per-expert layout of the Hub (Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``,
``w3``, ``w2``; Qwen's ``mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``). Its conversion mapping for the model's family says how, as data:
renamings of key fragments, and *converters* that stack per-expert tensors on a new
first dimension (``MergeModulelist(dim=0)``) and, for several source names,
concatenate the stacks on dimension 1 (``Concatenate(dim=1)``).

:func:`conversions_of` reads that mapping (transformers' own, no copy of it); a fused
weight missing from a checkpoint is then a :class:`Stacked` of the per-expert keys
present, and :meth:`Stacked.read` reads the experts asked for only (under expert
parallelism, those of this rank). Converters with other operations are not used (the
fused key stays missing, and the load names it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Conversions", "Stacked", "conversions_of", "stacked_sources"]

Reader = Callable[[str, int, int], torch.Tensor]
"""``read(key, start, stop)``: elements of a checkpoint tensor, 1-D."""


@dataclass(frozen=True)
class _Converter:
    sources: tuple[str, ...]
    """Per-expert key suffixes, ``*`` standing for the expert index."""
    target: str
    """The fused key's suffix."""


@dataclass(frozen=True)
class Conversions:
    """A family's checkpoint renamings and the converters mpar can read."""

    renamings: tuple[tuple[str, str], ...] = ()
    converters: tuple[_Converter, ...] = ()

    def rename(self, key: str) -> str:
        for pattern, replacement in self.renamings:
            key = re.sub(pattern, replacement, key)
        return key


def _readable(transform: object) -> bool:
    ops = [
        (type(op).__name__, getattr(op, "dim", None)) for op in getattr(transform, "operations", [])
    ]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def conversions_of(module: nn.Module) -> Conversions:
    """The conversions transformers applies when it loads ``module`` (none for a model
    of no Hugging Face family, or without transformers)."""
    if getattr(module, "config", None) is None:
        return Conversions()
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:
        return Conversions()
    renamings, converters = [], []
    for t in extract_weight_conversions_for_model(module) or []:  # type: ignore[arg-type]
        sources, targets = list(t.source_patterns), list(t.target_patterns)
        if type(t).__name__ == "WeightRenaming" and len(sources) == len(targets) == 1:
            renamings.append((sources[0], targets[0]))
        elif len(targets) == 1 and all("*" in s for s in sources) and _readable(t):
            converters.append(_Converter(tuple(sources), targets[0]))
    return Conversions(tuple(renamings), tuple(converters))


@dataclass(frozen=True)
class Stacked:
    """A fused expert weight of ``shape`` ``[E, ...]`` read from per-expert keys: expert
    ``e``'s slice is ``cat([keys[j][e] for j], dim=0)``."""

    keys: tuple[tuple[str, ...], ...]
    """Checkpoint key of source ``j``, expert ``e``: ``keys[j][e]``."""
    shape: torch.Size

    @property
    def names(self) -> list[str]:
        return [k for per_source in self.keys for k in per_source]

    def read(self, read: Reader, sizes: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the fused tensor (row-major, 1-D); only the
        experts they cover are read. ``sizes``: each source's element count."""
        per_expert = math.prod(self.shape[1:])
        first, last = start // per_expert, -(-stop // per_expert)
        experts = [
            torch.cat([read(keys[e], 0, n) for keys, n in zip(self.keys, sizes)])
            for e in range(first, last)
        ]
        if not experts:
            return torch.empty(0)
        flat = torch.cat(experts)
        return flat[start - first * per_expert : stop - first * per_expert]


def _sources(conv: _Converter, key: str, experts: int) -> tuple[tuple[str, ...], ...] | None:
    suffix = conv.target.lstrip(".")
    if not key.endswith(suffix) or (len(key) > len(suffix) and key[-len(suffix) - 1] != "."):
        return None
    prefix = key[: len(key) - len(suffix)]
    return tuple(
        tuple(prefix + s.lstrip(".").replace("*", str(e)) for e in range(experts))
        for s in conv.sources
    )


def stacked_sources(
    conversions: Conversions,
    missing: Sequence[str],
    shapes: Mapping[str, torch.Size],
    renamed: Mapping[str, str],
    ckpt_shapes: Mapping[str, torch.Size],
) -> dict[str, Stacked]:
    """Model key -> its :class:`Stacked` per-expert keys, for every ``missing`` fused
    weight (of ``shapes``) whose keys ``renamed`` (renamed key -> checkpoint key) all has,
    with shapes that stack and concatenate to it."""
    out: dict[str, Stacked] = {}
    for key in missing:
        shape = shapes[key]
        for conv in conversions.converters:
            found = _sources(conv, key, shape[0]) if len(shape) >= 2 else None
            if found is None or not all(k in renamed for ks in found for k in ks):
                continue
            keys = tuple(tuple(renamed[k] for k in ks) for ks in found)
            rows = [ckpt_shapes[ks[0]] for ks in keys]
            fits = all(tuple(r[1:]) == tuple(shape[2:]) for r in rows)
            if fits and sum(r[0] for r in rows) == shape[1]:
                out[key] = Stacked(keys, torch.Size(shape))
                break
    return out
