"""Schedule generators: pure functions of (num_stages, num_ranks, num_microbatches).

Index letters: ``p`` ranks, ``v = num_stages // p`` chunks per rank, ``m``
microbatches, ``r`` rank, ``c`` chunk, ``s = c * p + r`` stage, ``j``
microbatch, ``k`` the ``active_microbatches`` cap.

"In flight" on a rank counts (stage, microbatch) pairs whose forward has run
there and whose backward has not (see ``mpar.schedule.peak_in_flight``); with
``v > 1`` a pair holds one chunk's activations, about ``1/v`` of a microbatch.
"""

from __future__ import annotations

from mpar.errors import ScheduleError
from mpar.schedule._ir import Action, Kind, Schedule

__all__ = ["interleaved", "simple"]


def simple(
    num_stages: int,
    num_ranks: int,
    num_microbatches: int,
    *,
    active_microbatches: int | None = None,
    forward_only: bool = False,
) -> Schedule:
    """GPipe: every rank runs all its forwards, then all its backwards.

    With ``v = num_stages // num_ranks > 1`` (looped placement, stage ``s`` on
    rank ``s % p``) each rank runs its chunks in order for the forwards and in
    reverse order for the backwards ("looped BFS"). Rank x time with unit
    costs F=1, B=2 (``~`` continues an action, ``.`` is idle), ``p=2, m=4``::

        time   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14
        rank 0 0F0 0F1 0F2 0F3 .   .   .   0B0 ~~~ 0B1 ~~~ 0B2 ~~~ 0B3 ~~~
        rank 1 .   1F0 1F1 1F2 1F3 1B0 ~~~ 1B1 ~~~ 1B2 ~~~ 1B3 ~~~ .   .

    and ``p=2, v=2, m=2`` (stages 0 and 2 on rank 0, 1 and 3 on rank 1)::

        time   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14
        rank 0 0F0 0F1 2F0 2F1 .   .   .   2B0 ~~~ 2B1 ~~~ 0B0 ~~~ 0B1 ~~~
        rank 1 .   1F0 1F1 3F0 3F1 3B0 ~~~ 3B1 ~~~ 1B0 ~~~ 1B1 ~~~ .   .

    Unit-cost bubble fraction (``1 - busy / (p * makespan)``):
    ``1 - v*m / ((v-1)*max(m, p) + m + p - 1)``, which is ``(p-1)/(v*m+p-1)``
    when ``m >= p`` or ``v == 1``. Peak in flight per rank: ``v*m``.

    ``active_microbatches=k`` runs the microbatches in groups of ``k // v``
    (all forwards of a group, then its backwards), so at most ``k`` pairs are
    in flight; it needs ``k >= v``. ``forward_only=True`` keeps only the F
    actions (inference).
    """
    p, v, m = _check_shape(num_stages, num_ranks, num_microbatches)
    group = m
    if active_microbatches is not None and not forward_only:
        least = least_active_microbatches("simple", p, v)
        cap = _check_cap(active_microbatches, minimum=least, pipeline="simple", v=v)
        group = max(1, cap // v)
    actions = {r: _simple_rank(r, p, v, m, group, forward_only) for r in range(p)}
    return Schedule(num_stages, num_ranks, num_microbatches, actions, name="simple")


def _simple_rank(r: int, p: int, v: int, m: int, group: int, forward_only: bool) -> list[Action]:
    actions: list[Action] = []
    for first in range(0, m, group):
        microbatches = range(first, min(first + group, m))
        for c in range(v):
            actions += [Action(c * p + r, Kind.F, j) for j in microbatches]
        if forward_only:
            continue
        for c in reversed(range(v)):
            actions += [Action(c * p + r, Kind.B, j) for j in microbatches]
    return actions


def interleaved(
    num_stages: int,
    num_ranks: int,
    num_microbatches: int,
    *,
    active_microbatches: int | None = None,
    forward_only: bool = False,
) -> Schedule:
    """1F1B: a forward warm-up, then one forward and one backward in turn.

    With ``v == 1`` rank ``r`` warms up with ``min(p-1-r, m)`` forwards, so
    at most ``min(p-r, m)`` microbatches are in flight (``min(p, m)`` on
    rank 0). Rank x time with unit costs F=1, B=2, ``p=3, m=6``::

        time   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20  21  22  23
        rank 0 0F0 0F1 0F2 .   .   .   .   0B0 ~~~ 0F3 0B1 ~~~ 0F4 0B2 ~~~ 0F5 0B3 ~~~ .   0B4 ~~~ .   0B5 ~~~
        rank 1 .   1F0 1F1 .   .   1B0 ~~~ 1F2 1B1 ~~~ 1F3 1B2 ~~~ 1F4 1B3 ~~~ 1F5 1B4 ~~~ .   1B5 ~~~ .   .
        rank 2 .   .   2F0 2B0 ~~~ 2F1 2B1 ~~~ 2F2 2B2 ~~~ 2F3 2B3 ~~~ 2F4 2B4 ~~~ 2F5 2B5 ~~~ .   .   .   .

    With ``v > 1`` it is Megatron-LM's interleaved 1F1B: microbatches go in
    groups of ``p``; a rank runs a group's forwards through chunk 0, then
    chunk 1, ..., and the backwards chunk ``v-1`` first. Rank ``r`` warms up
    with ``(v-1)*p + 2*(p-1-r)`` forwards, so it holds at most
    ``min(v*m, (v+1)*p - 1 - 2*r)`` pairs in flight. It needs ``m`` to be a
    multiple of ``p``. Rank x step (list order), ``p=2, v=2, m=4``::

        step   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15
        rank 0 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        rank 1 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

    Unit-cost bubble fraction, for every valid ``(p, v, m)``:
    ``(p-1) / (v*m + p-1)`` (makespan ``(F+B) * (v*m + p-1)``); for ``v == 1``
    that is the 1F1B/GPipe figure ``(p-1)/(m+p-1)``, and it falls as ``v``
    grows.

    ``active_microbatches=k`` caps the warm-up at ``k-1`` forwards, so at most
    ``k`` pairs are in flight; with ``v > 1`` it needs ``k >= (v-1)*p + 1``
    (a rank's first backward needs the forward of its last chunk).
    ``forward_only=True`` keeps only the F actions, in the same order.
    """
    p, v, m = _check_shape(num_stages, num_ranks, num_microbatches)
    cap = check_interleaved(p, v, m, active_microbatches, forward_only, "interleaved")
    actions = {r: _interleaved_rank(r, p, v, m, cap, forward_only) for r in range(p)}
    return Schedule(num_stages, num_ranks, num_microbatches, actions, name="interleaved")


def _interleaved_rank(r: int, p: int, v: int, m: int, cap: int, forward_only: bool) -> list[Action]:
    forwards = [Action(s, Kind.F, j) for s, j in _chunk_order(r, p, v, m, reverse=False)]
    if forward_only:
        return forwards
    backwards = [Action(s, Kind.B, j) for s, j in _chunk_order(r, p, v, m, reverse=True)]
    default_warmup = p - 1 - r if v == 1 else (v - 1) * p + 2 * (p - 1 - r)
    warmup = min(default_warmup, cap - 1, v * m)
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        actions += [forward, backward]
    actions += backwards[v * m - warmup :]
    return actions


def _chunk_order(r: int, p: int, v: int, m: int, *, reverse: bool) -> list[tuple[int, int]]:
    """(stage, microbatch) pairs of rank ``r`` in Megatron order, groups of ``p``."""
    if v == 1:
        return [(r, j) for j in range(m)]
    order = []
    for index in range(v * m):
        group, within = divmod(index, p * v)
        c = within // p
        if reverse:
            c = v - 1 - c
        order.append((c * p + r, group * p + within % p))
    return order


def _check_shape(num_stages: int, num_ranks: int, num_microbatches: int) -> tuple[int, int, int]:
    _check_positive("num_stages", num_stages)
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    if num_stages % num_ranks:
        raise ScheduleError(
            f"num_stages ({num_stages}) must be a multiple of num_ranks ({num_ranks}); "
            f"use {num_ranks * max(1, num_stages // num_ranks)} stages"
        )
    return num_ranks, num_stages // num_ranks, num_microbatches


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    return value


def least_active_microbatches(pipeline: str, num_ranks: int, virtual_stages: int) -> int:
    """The smallest ``active_microbatches`` that ``pipeline`` runs with: ``simple`` needs
    ``v`` (a group holds every chunk of a microbatch); ``interleaved`` and ``zero_bubble``
    need ``(v-1)*p + 1`` (a rank's first backward needs the forward of its last chunk);
    any other schedule 1."""
    p, v = num_ranks, virtual_stages
    if pipeline == "simple":
        return v
    if pipeline in ("interleaved", "zero_bubble"):
        return (v - 1) * p + 1
    return 1


def _check_cap(value: object, *, minimum: int, pipeline: str, v: int) -> int:
    value = _check_positive("active_microbatches", value)
    if value < minimum:
        raise ScheduleError(
            f"{pipeline} with {v} virtual stages needs active_microbatches >= {minimum} "
            f"(got {value}): a rank must hold {minimum} (stage, microbatch) pairs "
            "before its first backward"
        )
    return value


def check_interleaved(
    p: int, v: int, m: int, active_microbatches: int | None, forward_only: bool, pipeline: str
) -> int:
    """The requirements of 1F1B's order (``interleaved`` and ``zero_bubble``, named by
    ``pipeline`` in the errors); returns the cap on pairs in flight per rank."""
    if v > 1 and m % p:
        raise ScheduleError(_multiple_message(p, v, m, pipeline))
    if active_microbatches is None or forward_only:
        return v * m
    least = least_active_microbatches("interleaved", p, v)
    return _check_cap(active_microbatches, minimum=least, pipeline=pipeline, v=v)


def _multiple_message(p: int, v: int, m: int, pipeline: str) -> str:
    below, above = (m // p) * p, (m // p + 1) * p
    fix = f"use {below} or {above}" if below else f"use {above}"
    return (
        f"{pipeline} with {v} virtual stages needs microbatches to be a multiple of "
        f"the pipeline degree {p} (got {m}); {fix}"
    )
