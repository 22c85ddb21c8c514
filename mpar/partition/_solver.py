"""Optimal contiguous partitioning of a cost sequence (pure Python, no torch).

The problem: cut ``n`` units, in execution order, into ``k`` non-empty contiguous
stages so that the most expensive stage is as cheap as possible, with every
stage's memory under a cap.

A stage ``[s, e)`` costs::

    (1 - w) * sum(compute[s:e]) / sum(compute)      # normalised compute
  +      w  * sum(memory[s:e])  / sum(memory)       # normalised memory
  + (1 - w) * comm[e - 1]       / sum(compute)      # sending its output on (not for the last stage)

Every constraint is *suffix-closed*: if ``[s, e)`` is feasible then so is
``[s', e)`` for any ``s <= s' < e``. For such constraints the greedy that
extends each stage as far as it can (while leaving one unit for every stage
still to come) decides exactly whether a bottleneck ``B`` is achievable, so a
bisection on ``B`` finds the optimum. Each probe costs ``O(k log n)`` with
prefix sums (plus a short backward scan when ``comm`` is given). The bisection
stops when the gap between an infeasible and an *achieved* bottleneck is below
``1e-12`` relative: the returned partition is optimal to float precision.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence

from mpar.config import MEMORY_WEIGHT_FOR
from mpar.errors import PartitionError

__all__ = [
    "DeferredError",
    "memory_weight_for",
    "min_memory_for",
    "min_stages_for",
    "solve",
    "stage_costs",
]

_REL_TOL = 1e-12
_MAX_PROBES = 200


def memory_weight_for(optimize: str, memory_weight: float | None = None) -> float:
    """The memory weight to use: ``memory_weight`` if given, else the default of ``optimize``."""
    if memory_weight is not None:
        w = float(memory_weight)
        if not 0.0 <= w <= 1.0:
            raise PartitionError(f"memory_weight must be in [0, 1], got {memory_weight!r}")
        return w
    if optimize not in MEMORY_WEIGHT_FOR:
        raise PartitionError(f"optimize must be 'speed' or 'memory', got {optimize!r}")
    return MEMORY_WEIGHT_FOR[optimize]


class _Costs:
    """Normalised per-unit costs with prefix sums; answers stage cost queries in O(1)."""

    def __init__(
        self,
        compute: Sequence[float],
        memory: Sequence[float] | None,
        memory_weight: float,
        comm: Sequence[float] | None,
    ) -> None:
        n = len(compute)
        total_compute = math.fsum(compute)
        mem = [0.0] * n if memory is None else [float(x) for x in memory]
        total_memory = math.fsum(mem)
        cw, mw = 1.0 - memory_weight, memory_weight
        # divide element by element: 1 / total overflows for tiny (subnormal) totals
        c_share = [float(c) / total_compute if total_compute > 0 else 0.0 for c in compute]
        m_share = [m / total_memory if total_memory > 0 else 0.0 for m in mem]
        unit = [cw * c + mw * m for c, m in zip(c_share, m_share)]
        self.n = n
        self.prefix = [0.0, *itertools.accumulate(unit)]
        self.mem_prefix = [0.0, *itertools.accumulate(mem)]
        self.comm = (
            None
            if comm is None
            else [cw * (float(c) / total_compute if total_compute > 0 else 0.0) for c in comm]
        )

    def cost(self, start: int, end: int) -> float:
        """Cost of stage ``[start, end)``."""
        value = self.prefix[end] - self.prefix[start]
        if self.comm is not None and end < self.n:
            value += self.comm[end - 1]
        return value

    def memory(self, start: int, end: int) -> float:
        return self.mem_prefix[end] - self.mem_prefix[start]


def _validate(
    compute: Sequence[float],
    num_stages: int,
    memory: Sequence[float] | None,
    comm: Sequence[float] | None,
) -> None:
    n = len(compute)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages must be a positive integer, got {num_stages!r}")
    if n < num_stages:
        raise PartitionError(
            f"cannot split {n} units into {num_stages} non-empty stages; "
            f"use at most {n} stages or split the model into finer units"
        )
    for name, seq in (("compute", compute), ("memory", memory), ("comm", comm)):
        if seq is None:
            continue
        if len(seq) != n:
            raise PartitionError(f"{name} has {len(seq)} entries but compute has {n}")
        bad = [i for i, x in enumerate(seq) if not (math.isfinite(x) and x >= 0)]
        if bad:
            raise PartitionError(
                f"{name}[{bad[0]}] = {seq[bad[0]]!r}: costs must be finite and >= 0"
            )


def _greedy(costs: _Costs, k: int, bound: float, cap: float) -> list[int] | None:
    """Stage starts reaching ``n`` with every stage within ``bound`` and ``cap``, or None."""
    n = costs.n
    starts: list[int] = []
    start = 0
    for j in range(k):
        starts.append(start)
        if j == k - 1:
            ok = costs.cost(start, n) <= bound and costs.memory(start, n) <= cap
            return starts if ok else None
        last = n - (k - 1 - j)  # leave one unit for each remaining stage
        end = _farthest(costs, start, last, bound, cap)
        if end is None:
            return None
        start = end
    return None  # pragma: no cover - the loop always returns


def _farthest(costs: _Costs, start: int, last: int, bound: float, cap: float) -> int | None:
    """Largest ``end`` in ``(start, last]`` with stage ``[start, end)`` feasible, or None."""
    # Without comm both constraints are monotone in `end`: bisect the prefix sums.
    hi = bisect.bisect_right(costs.prefix, costs.prefix[start] + bound, lo=start + 1) - 1
    hi = min(
        hi, bisect.bisect_right(costs.mem_prefix, costs.mem_prefix[start] + cap, start + 1) - 1
    )
    hi = min(hi, last)
    if costs.comm is None:
        return hi if hi > start else None
    for end in range(hi, start, -1):  # comm is not monotone: scan back from the bound
        if costs.cost(start, end) <= bound:
            return end
    return None


def _bottleneck(costs: _Costs, starts: Sequence[int]) -> float:
    ends = [*starts[1:], costs.n]
    return max(costs.cost(s, e) for s, e in zip(starts, ends))


def stage_costs(
    compute: Sequence[float],
    starts: Sequence[int],
    *,
    memory: Sequence[float] | None = None,
    memory_weight: float = 0.0,
    comm: Sequence[float] | None = None,
) -> list[float]:
    """The cost of every stage of the partition ``starts`` under ``solve``'s cost model."""
    costs = _Costs(compute, memory, memory_weight, comm)
    ends = [*starts[1:], costs.n]
    return [costs.cost(s, e) for s, e in zip(starts, ends)]


def _min_bottleneck(costs: _Costs, k: int, cap: float) -> list[int] | None:
    """Optimal starts for ``k`` stages under memory ``cap``; None when nothing fits."""
    best = _greedy(costs, k, math.inf, cap)
    if best is None:
        return None
    hi = _bottleneck(costs, best)
    lo = 0.0
    if _greedy(costs, k, 0.0, cap) is not None:
        return _greedy(costs, k, 0.0, cap)
    for _ in range(_MAX_PROBES):
        if hi - lo <= _REL_TOL * hi:
            break
        mid = (lo + hi) / 2
        starts = _greedy(costs, k, mid, cap)
        if starts is None:
            lo = mid
        else:
            best, hi = starts, _bottleneck(costs, starts)
    return best


def solve(
    compute: Sequence[float],
    num_stages: int,
    *,
    memory: Sequence[float] | None = None,
    memory_weight: float = 0.0,
    memory_cap: float | None = None,
    comm: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
) -> list[int]:
    """Split units into ``num_stages`` contiguous stages minimising the costliest stage.

    Args:
        compute: per-unit compute cost (seconds, FLOPs, parameter counts — any unit).
        num_stages: number of stages, at most ``len(compute)``.
        memory: per-unit memory in bytes (needed for ``memory_weight`` and ``memory_cap``).
        memory_weight: ``w`` in ``(1 - w) * compute share + w * memory share``.
        memory_cap: largest memory a stage may hold, in ``memory``'s unit.
        comm: per-unit cost of sending that unit's output to the next stage, in
            ``compute``'s unit; charged to a stage that ends with that unit.
        names: unit names, used only in error messages.

    Returns:
        The start index of every stage; ``result[0] == 0``.

    Raises:
        PartitionError: bad input, or no split keeps every stage under ``memory_cap``
            (the message names the smallest memory and the smallest degree that fit).
    """
    _validate(compute, num_stages, memory, comm)
    w = memory_weight_for("speed", memory_weight)
    if memory_cap is not None and memory is None:
        raise PartitionError("memory_cap needs per-unit memory: pass memory=[bytes per unit]")
    costs = _Costs(compute, memory, w, comm)
    cap = math.inf if memory_cap is None else float(memory_cap)
    starts = _min_bottleneck(costs, num_stages, cap)
    if starts is None:
        inputs = (list(memory or []), num_stages, cap, names)
        raise DeferredError(lambda: _no_fit_message(*inputs))
    return starts


class DeferredError(PartitionError):
    """A ``PartitionError`` whose message is composed only when read: the auto search
    discards tens of thousands of layouts that do not fit, and composing why (the no-fit
    message solves again without a cap; the planner adds what the cap reserves) cost
    more than laying them out."""

    def __init__(self, compose: Callable[[], str]) -> None:
        super().__init__()
        self._compose: Callable[[], str] | None = compose
        self._message = ""

    def __str__(self) -> str:
        if self._compose is not None:
            self._message, self._compose = self._compose(), None
        return self._message

    def __reduce__(self) -> tuple[type[PartitionError], tuple[str]]:
        return PartitionError, (str(self),)  # pickled (sent between ranks) as its message


def min_memory_for(memory: Sequence[float], num_stages: int) -> float:
    """Smallest per-stage memory cap at which ``num_stages`` contiguous stages fit."""
    starts = solve(memory, num_stages)
    ends = [*starts[1:], len(memory)]
    return max(math.fsum(memory[s:e]) for s, e in zip(starts, ends))


def min_stages_for(memory: Sequence[float], cap: float) -> int | None:
    """Fewest contiguous stages with every stage's memory <= ``cap``; None if a unit alone is over."""
    if any(m > cap for m in memory):
        return None
    stages, used = 1, 0.0
    for m in memory:
        if used + m > cap:
            stages, used = stages + 1, 0.0
        used += m
    return stages


def _no_fit_message(
    memory: Sequence[float], num_stages: int, cap: float, names: Sequence[str] | None
) -> str:
    need = min_memory_for(memory, num_stages)
    degree = min_stages_for(memory, cap)
    biggest = max(range(len(memory)), key=lambda i: memory[i])
    msg = (
        f"no split into {num_stages} stages fits a memory cap of {_fmt(cap)} per stage: "
        f"{num_stages} stages need at least {_fmt(need)} per stage"
    )
    if degree is None:
        msg += (
            f", and unit {names[biggest] if names else biggest!r} alone needs {_fmt(memory[biggest])}, so no pipeline degree "
            "fits this memory; use larger devices, ZeRO sharding or offload"
        )
    elif degree > len(memory):
        msg += f"; even one unit per stage ({len(memory)} stages) does not fit"
    else:
        msg += f"; at this memory the smallest pipeline degree that fits is {degree}"
    return msg


def _fmt(nbytes: float) -> str:
    """Bytes as a short human string (GiB, MiB, ...)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover
