"""The registry of schedule names: config validation, the planner, the CLI and docs read it.

``build_schedule(name, p, m, ...)`` builds the schedule a config names.
"""

from __future__ import annotations

from collections.abc import Callable

from mpar.errors import ScheduleError
from mpar.schedule._csv import is_csv_path, read_csv
from mpar.schedule._generators import _check_positive, interleaved, simple
from mpar.schedule._ir import COMMUNICATION_KINDS, Schedule
from mpar.schedule._lower import lower_communication
from mpar.schedule._shard_lower import lower_sharding
from mpar.schedule._validate import validate
from mpar.schedule._zero_bubble import zbv, zero_bubble

__all__ = [
    "PIPELINES",
    "SCHEDULE_HELP",
    "build_schedule",
    "check_csv_schedule",
    "check_csv_shape",
    "ZERO3_PREFETCH",
    "executable_schedule",
    "lower",
    "placement_of",
]

_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "simple": simple,
    "interleaved": interleaved,
    "zero_bubble": zero_bubble,
    "zbv": zbv,
}
PIPELINES = tuple(_GENERATORS)
"""Every schedule name ``"pipeline"`` accepts."""
SCHEDULE_HELP = {
    "simple": "GPipe: all forwards, then all backwards",
    "interleaved": "1F1B (Megatron's interleaved 1F1B with virtual stages)",
    "zero_bubble": "ZB-H1: 1F1B with the backward split into I and W, W deferred into bubbles",
    "zbv": "ZBV: two chunks per rank in a V, split backward, near-zero bubble (virtual_stages 2)",
}


def build_schedule(
    pipeline: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    active_microbatches: int | None = None,
    forward_only: bool = False,
) -> Schedule:
    """The schedule for the config keys of the same names.

    ``num_ranks`` is the pipeline degree ``p``; the schedule has
    ``p * virtual_stages`` stages.
    """
    if is_csv_path(pipeline):
        return _from_file(pipeline, num_ranks, num_microbatches, virtual_stages, forward_only)
    if pipeline not in _GENERATORS:
        known = ", ".join(f"{name!r} ({SCHEDULE_HELP[name]})" for name in PIPELINES)
        raise ScheduleError(
            f"unknown pipeline {pipeline!r}: use one of {known}, or a schedule CSV file"
        )
    _check_positive("virtual_stages", virtual_stages)
    _check_positive("num_ranks", num_ranks)
    return _GENERATORS[pipeline](
        num_ranks * virtual_stages,
        num_ranks,
        num_microbatches,
        active_microbatches=active_microbatches,
        forward_only=forward_only,
    )


ZERO3_PREFETCH = 1
"""ZeRO-3: compute actions by which each UNSHARD (an asynchronous gather) runs ahead of
its stage's first use (``lower_sharding(..., prefetch=...)``)."""


def lower(
    schedule: Schedule,
    *,
    zero_stage: int | None = None,
    reshard_gap: int | None = 1,
    prefetch: int = ZERO3_PREFETCH,
) -> Schedule:
    """``schedule`` as the runtime executes it.

    :func:`lower_communication` (SEND_F, RECV_F, SEND_B, RECV_B between ranks;
    kept as they are when ``schedule`` already has them, as a CSV file may) and,
    when ``zero_stage`` is not None (the model's parameters go through mpar's
    data-parallel buckets), :func:`lower_sharding` (UNSHARD, RESHARD, REDUCE_GRAD)
    with the runtime's defaults: ``reshard_gap=1`` is ``zero.reshard_after_forward``
    (None when it is off).
    """
    if not any(a.kind in COMMUNICATION_KINDS for a in schedule.iter_actions()):
        schedule = lower_communication(schedule)
    if zero_stage is not None:
        schedule = lower_sharding(schedule, zero_stage, reshard_gap=reshard_gap, prefetch=prefetch)
    return schedule


def executable_schedule(
    pipeline: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    active_microbatches: int | None = None,
    forward_only: bool = False,
    zero_stage: int | None = None,
    reshard_gap: int | None = 1,
    prefetch: int = ZERO3_PREFETCH,
) -> Schedule:
    """The schedule exactly as the runtime executes it: :func:`build_schedule`, then
    :func:`lower`. ``mpar schedule`` prints and simulates this object, each rank
    executes its own list of it action by action, and a traced run records it beside
    its timings."""
    schedule = build_schedule(
        pipeline,
        num_ranks,
        num_microbatches,
        virtual_stages=virtual_stages,
        active_microbatches=active_microbatches,
        forward_only=forward_only,
    )
    return lower(schedule, zero_stage=zero_stage, reshard_gap=reshard_gap, prefetch=prefetch)


def _from_file(
    path: str, num_ranks: int, num_microbatches: int, virtual_stages: int, forward_only: bool
) -> Schedule:
    schedule = read_csv(path, forward_only=forward_only)
    check_csv_schedule(schedule, path, num_ranks, num_microbatches, virtual_stages)
    return schedule


def check_csv_schedule(
    schedule: Schedule,
    path: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int,
    *,
    cli: bool = False,
) -> None:
    """What ``mpar schedule`` (``cli``) and ``mpar.init`` check of a schedule read from
    ``path``: its shape against the config (or the command line's flags), then the
    schedule as the ranks run it (lowered with its transfers: orders, counts, receives
    in the order of the sends)."""
    check_csv_shape(schedule, path, num_ranks, num_microbatches, virtual_stages, cli=cli)
    try:
        validate(lower(schedule))
    except ScheduleError as exc:
        raise ScheduleError(f"{path!r}: {exc}") from None


def check_csv_shape(
    schedule: Schedule,
    path: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int,
    *,
    cli: bool = False,
) -> None:
    """A schedule read from ``path`` must match the config's pipeline shape (``cli``:
    ``mpar schedule``'s --stages and --microbatches)."""
    wanted = (num_ranks, virtual_stages, num_microbatches)
    found = (schedule.num_ranks, schedule.virtual_stages, schedule.num_microbatches)
    if wanted != found:
        asker, fix = (
            ("--stages and --microbatches ask", "leave them out (the file gives its shape)")
            if cli
            else (
                "the config asks",
                "set pipeline_parallel_degree, virtual_stages and microbatches",
            )
        )
        raise ScheduleError(
            f"the schedule in {path!r} has {found[0]} ranks x {found[1]} virtual stages and "
            f"{found[2]} microbatches, but {asker} for {wanted[0]} x {wanted[1]} and "
            f"{wanted[2]}; {fix} to match"
        )


def placement_of(pipeline: str) -> str:
    """How the named schedule places stages on ranks (``mpar.schedule.PLACEMENTS``)."""
    if is_csv_path(pipeline):
        return read_csv(pipeline).placement
    return "v" if pipeline == "zbv" else "looped"
