"""The ranks of one pipeline must feed the same batch: checked, cheaply.

Every rank of a pipeline calls the step with the whole batch: stage 0 uses
the inputs, the last stage the targets. A data loader sharded by global rank
(a default ``DistributedSampler``) gives each stage other samples, and the
model trains on inputs paired with the wrong targets without any error. So
on the first :data:`FIRST_STEPS` steps and every :data:`EVERY` steps after,
each rank takes a fingerprint of its microbatches — per tensor its shape,
dtype and two sums over a strided sample of at most ~512 elements — and after
the step (where every rank is at the same point, before the optimizer steps)
one all-gather compares them within every model replica: the ranks of one
data-parallel rank, its pipeline stages and (with tensor or context parallelism)
their TP and CP ranks — the fingerprints are taken before the sequences are cut
for context parallelism. A mismatch raises
:class:`~mpar.errors.BatchMismatchError` on every rank, naming the ranks and
the fix (shard by ``dp_rank()``/``dp_size()``, or ``mpar.data_sampler``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mpar import _device
from mpar.comm import ProcessGrid
from mpar.comm._consistency import first_few, gather_from_every_rank
from mpar.errors import BatchMismatchError
from mpar.topology import Grid

__all__ = [
    "EVERY",
    "FIRST_STEPS",
    "batch_check_due",
    "check_same_batch",
    "due_fingerprint",
    "fingerprint",
    "mismatches",
    "replicas",
]

FIRST_STEPS = 3
EVERY = 50
_SAMPLE = 256
"""A tensor is sampled at a stride of ``numel // _SAMPLE`` (up to 2 x _SAMPLE values)."""

Print = tuple[str, tuple[int, ...], str, float, float]
"""(where, shape, dtype, sum, position-weighted sum) of one tensor."""


def _tensors(value: object, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]")


def _sums(t: torch.Tensor) -> torch.Tensor:
    """The two sums (float64, where ``t`` is) over a strided sample of ``t``."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=t.device)
    sample = flat[:: max(1, flat.numel() // _SAMPLE)].to(torch.float64)
    sample = torch.nan_to_num(sample.real if sample.is_complex() else sample)
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
    return torch.stack([sample.sum(), (sample * weights).sum()])


def fingerprint(args: list[tuple[object, ...]], kwargs: list[dict[str, object]]) -> list[Print]:
    """The fingerprint of every tensor of every microbatch (a small list). The sums of
    the tensors of one device come to the host in one copy: one synchronization per
    device, however many microbatches."""
    found: list[tuple[str, torch.Tensor]] = []
    for m, (a, k) in enumerate(zip(args, kwargs)):
        found += [
            *_tensors(list(a), f"microbatch {m} args"),
            *_tensors(k, f"microbatch {m} kwargs"),
        ]
    sums: list[tuple[float, float]] = [(0.0, 0.0)] * len(found)
    for device in {t.device for _, t in found}:
        mine = [i for i, (_, t) in enumerate(found) if t.device == device]
        _device.SYNCS.count("batch check fingerprints")
        values = torch.stack([_sums(found[i][1]) for i in mine]).tolist()
        for i, pair in zip(mine, values):
            sums[i] = (float(pair[0]), float(pair[1]))
    return [(where, tuple(t.shape), str(t.dtype), *pair) for (where, t), pair in zip(found, sums)]


def _first_difference(a: list[Print], b: list[Print]) -> str:
    if len(a) != len(b):
        return f"{len(a)} tensors against {len(b)}"
    for x, y in zip(a, b):
        if x[1:3] != y[1:3]:
            return f"{x[0]}: shape {x[1]} {x[2]} against {y[1]} {y[2]}"
        if x != y:
            return f"{x[0]}: same shape {x[1]}, other values"
    return "?"


def mismatches(
    prints: list[list[Print]], replicas: list[list[int]], label: str = "pipeline"
) -> list[str]:
    """``"ranks 0 and 1 (pipeline [0, 1]): ..."`` for each rank whose batch differs
    from the first rank of its model replica (``label`` names the group)."""
    found = []
    for ranks in replicas:
        first = ranks[0]
        for other in ranks[1:]:
            if prints[other] != prints[first]:
                found.append(
                    f"ranks {first} and {other} ({label} {ranks}): "
                    f"{_first_difference(prints[first], prints[other])}"
                )
    return found


def replicas(grid: Grid) -> list[list[int]]:
    """The ranks of each model replica (one data-parallel rank): its pipeline stages
    and their tensor- and context-parallel ranks, which all read the same batch."""
    return [
        sorted(
            grid.rank_of(p, d, t, c)
            for p in range(grid.pp_size)
            for t in range(grid.tp_size)
            for c in range(grid.cp_size)
        )
        for d in range(grid.dp_size)
    ]


def _label(grid: Grid) -> str:
    inner = [n for n, size in (("tensor", grid.tp_size), ("context", grid.cp_size)) if size > 1]
    if not inner:
        return "pipeline"
    return f"model replica (pipeline x {' x '.join(f'{n} parallel' for n in inner)})"


def batch_check_due(calls: int) -> bool:
    """Whether the step after ``calls`` counted ones is checked: the first
    :data:`FIRST_STEPS`, then every :data:`EVERY`."""
    return calls < FIRST_STEPS or calls % EVERY == 0


def due_fingerprint(
    grid: ProcessGrid,
    due: Callable[[], bool],
    args: list[tuple[object, ...]],
    kwargs: list[dict[str, object]],
) -> list[Print] | None:
    """Before a step: this rank's fingerprint when the step is checked (``due()``
    counts the step and says whether), else None (always None, and nothing counted,
    when a model replica is one rank)."""
    if grid.pp_size * grid.tp_size * grid.cp_size == 1 or not due():
        return None
    return fingerprint(args, kwargs)


def check_same_batch(grid: ProcessGrid, mine: list[Print] | None) -> None:
    """After a checked step (every rank at the same point: no other collective can
    cross it), compare the fingerprints within every pipeline; raise
    BatchMismatchError on every rank if they differ. The optimizer has not
    stepped yet: the parameters are untouched."""
    if mine is None:
        return
    layout = grid.topology
    prints = gather_from_every_rank(mine, grid.world_size, "same-batch check")
    found = mismatches(prints, replicas(layout), _label(layout))
    if found:
        shown = first_few(found, 4)
        raise BatchMismatchError(
            f"the ranks of a {_label(layout)} were given different batches: {shown}. Every "
            "rank of a pipeline (and of a tensor- or context-parallel group) must call the "
            "step with the "
            "same batch (stage 0 reads the inputs, the last stage the targets). Shard the data by data-parallel rank, not by "
            "global rank: DataLoader(dataset, sampler=mpar.data_sampler(dataset)), or "
            "DistributedSampler(dataset, num_replicas=mpar.dp_size(), rank=mpar.dp_rank())"
        )
