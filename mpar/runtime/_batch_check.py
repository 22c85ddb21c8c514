"""The ranks of one pipeline must feed the same batch: checked, cheaply.

Every rank of a pipeline calls the step with the whole batch: stage 0 uses
the inputs, the last stage the targets. A data loader sharded by global rank
(a default ``DistributedSampler``) gives each stage other samples, and the
model trains on inputs paired with the wrong targets without any error. So
on the first :data:`FIRST_STEPS` steps and every :data:`EVERY` steps after,
each rank takes a fingerprint of its microbatches — per tensor its shape,
dtype and two sums over a strided sample of at most ~512 elements — and one
all-gather compares them within every pipeline. A mismatch raises
:class:`~mpar.errors.BatchMismatchError` on every rank, naming the ranks and
the fix (shard by ``dp_rank()``/``dp_size()``, or ``mpar.data_sampler``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mpar.comm._consistency import gather_from_every_rank
from mpar.errors import BatchMismatchError

__all__ = ["EVERY", "FIRST_STEPS", "check_same_batch", "fingerprint", "mismatches"]

FIRST_STEPS = 3
EVERY = 50
_SAMPLE = 256
"""A tensor is sampled at a stride of ``numel // _SAMPLE`` (up to 2 x _SAMPLE values)."""

Print = tuple[str, tuple[int, ...], str, float, float]
"""(where, shape, dtype, sum, position-weighted sum) of one tensor."""


def _tensors(value: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]")


def _sums(t: torch.Tensor) -> tuple[float, float]:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0, 0.0
    sample = flat[:: max(1, flat.numel() // _SAMPLE)].to(torch.float64)
    sample = torch.nan_to_num(sample.real if sample.is_complex() else sample)
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
    both = torch.stack([sample.sum(), (sample * weights).sum()]).tolist()
    return float(both[0]), float(both[1])


def fingerprint(args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]) -> list[Print]:
    """The fingerprint of every tensor of every microbatch (a small list)."""
    out: list[Print] = []
    for m, (a, k) in enumerate(zip(args, kwargs)):
        found = [*_tensors(list(a), f"microbatch {m} args"), *_tensors(k, f"microbatch {m} kwargs")]
        for where, t in found:
            out.append((where, tuple(t.shape), str(t.dtype), *_sums(t)))
    return out


def _first_difference(a: list[Print], b: list[Print]) -> str:
    if len(a) != len(b):
        return f"{len(a)} tensors against {len(b)}"
    for x, y in zip(a, b):
        if x[1:3] != y[1:3]:
            return f"{x[0]}: shape {x[1]} {x[2]} against {y[1]} {y[2]}"
        if x != y:
            return f"{x[0]}: same shape {x[1]}, other values"
    return "?"


def mismatches(prints: list[list[Print]], pipelines: list[list[int]]) -> list[str]:
    """``"ranks 0 and 1 (pipeline [0, 1]): ..."`` for each rank whose batch differs
    from its pipeline's first rank."""
    found = []
    for ranks in pipelines:
        first = ranks[0]
        for other in ranks[1:]:
            if prints[other] != prints[first]:
                found.append(
                    f"ranks {first} and {other} (pipeline {ranks}): "
                    f"{_first_difference(prints[first], prints[other])}"
                )
    return found


def _due(st: Any) -> bool:
    calls = st.extras.get("batch_check_calls", 0)
    st.extras["batch_check_calls"] = calls + 1
    return calls < FIRST_STEPS or calls % EVERY == 0


def check_same_batch(st: Any, args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]) -> None:
    """Collective, on the steps that are due: raise BatchMismatchError on every rank
    unless each pipeline's ranks hold the same microbatches."""
    pipelines = st.grid.pp_groups
    if max(len(p) for p in pipelines) == 1 or not _due(st):
        return
    prints = gather_from_every_rank(
        fingerprint(args, kwargs), st.layout.world_size, "same-batch check"
    )
    found = mismatches(prints, pipelines)
    if found:
        shown = "; ".join(found[:4]) + ("; ..." if len(found) > 4 else "")
        raise BatchMismatchError(
            f"the ranks of a pipeline were given different batches: {shown}. Every rank of "
            "a pipeline must call the step with the same batch (stage 0 reads the inputs, "
            "the last stage the targets). Shard the data by data-parallel rank, not by "
            "global rank: DataLoader(dataset, sampler=mpar.data_sampler(dataset)), or "
            "DistributedSampler(dataset, num_replicas=mpar.dp_size(), rank=mpar.dp_rank())"
        )
