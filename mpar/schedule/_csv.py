"""Schedules as CSV, in torch.distributed.pipelining's format.

One row per rank, one action per cell in execution order (``0F0,0F1,0I0,...``);
an empty cell is an idle slot and is skipped on reading. This is what
torch's ``PipelineScheduleMulti._dump_csv`` writes and ``_load_csv`` reads, so
schedules move between the two. A file holds compute actions only (mpar then
adds the transfers itself, ``lower_communication``) or compute and
communication actions (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B`` for every
edge between ranks, which then run in the file's order); sharding actions come
from the config (``zero``), never from the file.

``"pipeline": "path/to/schedule.csv"`` in the config runs such a schedule: it
is read, its placement recognised (stage ``s`` on rank ``s % p``, looped; or
ZBV's V with two stages per rank) and validated before any process starts.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from mpar.errors import ScheduleError
from mpar.schedule._ir import (
    COMMUNICATION_KINDS,
    COMPUTE_KINDS,
    PLACEMENTS,
    Action,
    Kind,
    Schedule,
    stage_rank,
)
from mpar.schedule._validate import validate

__all__ = ["is_csv_path", "read_csv", "schedule_from_csv", "schedule_to_csv", "write_csv"]


def is_csv_path(pipeline: object) -> bool:
    """Whether a ``pipeline`` config value names a schedule file rather than a generator."""
    return isinstance(pipeline, str | os.PathLike) and str(pipeline).lower().endswith(".csv")


def schedule_to_csv(schedule: Schedule, *, communication: bool = False) -> str:
    """The compute actions of every rank (with ``communication``, also its transfers),
    one row per rank."""
    kept = COMPUTE_KINDS | COMMUNICATION_KINDS if communication else COMPUTE_KINDS
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for r in range(schedule.num_ranks):
        writer.writerow([str(a) for a in schedule.actions.get(r, []) if a.kind in kept])
    return out.getvalue()


def write_csv(
    schedule: Schedule, path: str | os.PathLike[str], *, communication: bool = False
) -> None:
    Path(path).write_text(schedule_to_csv(schedule, communication=communication))


def schedule_from_csv(text: str, *, name: str = "csv") -> Schedule:
    """Parse, place and validate a schedule (raises ``ScheduleError`` saying what is wrong)."""
    rows = [row for row in csv.reader(io.StringIO(text))]
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError("the schedule CSV is empty: expected one row of actions per rank")
    actions: dict[int, list[Action]] = {}
    for r, row in enumerate(rows):
        parsed = [Action.parse(cell) for cell in row if cell.strip()]
        bad = [a for a in parsed if a.kind not in COMPUTE_KINDS | COMMUNICATION_KINDS]
        if bad:
            raise ScheduleError(
                f"rank {r} of the schedule CSV has {bad[0]}: only compute (F, B, I, W) and "
                "communication (SEND_F, RECV_F, SEND_B, RECV_B) actions belong in it; mpar "
                "adds the sharding actions itself, from the config's 'zero' section"
            )
        actions[r] = parsed
    everything = [a for row in actions.values() for a in row]
    if not everything:
        raise ScheduleError("the schedule CSV holds no actions")
    p = len(rows)
    num_stages = max(a.stage for a in everything) + 1
    m = max(a.microbatch or 0 for a in everything) + 1
    if num_stages % p:
        raise ScheduleError(
            f"the schedule CSV has {num_stages} stages on {p} ranks; mpar places stage s on "
            f"rank s % {p}, so the number of stages must be a multiple of {p}"
        )
    placement = _placement(actions, num_stages, p)
    schedule = Schedule(num_stages, p, m, actions, name=name, placement=placement)
    validate(schedule)
    return schedule


def _placement(actions: dict[int, list[Action]], num_stages: int, p: int) -> str:
    """The placement (``PLACEMENTS``) every action of the file agrees with."""
    for placement in PLACEMENTS:
        if placement == "v" and num_stages != 2 * p:
            continue
        if all(
            stage_rank(a.stage, num_stages, p, placement) == r
            for r, row in actions.items()
            for a in row
        ):
            return placement
    r, a = next((r, a) for r, row in actions.items() for a in row if a.stage % p != r)
    raise ScheduleError(
        f"rank {r} of the schedule CSV runs {a}: mpar places stage s on rank s % {p} (looped) "
        f"or, with two stages per rank, in a V (stage s < {p} on rank s, else {2 * p - 1} - s); "
        "this file follows neither"
    )


def read_csv(path: str | os.PathLike[str], *, forward_only: bool = False) -> Schedule:
    """The schedule in the CSV file at ``path``; ``forward_only`` keeps its F actions."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ScheduleError(f"cannot read the schedule CSV {str(path)!r}: {exc}") from None
    try:
        schedule = schedule_from_csv(text, name=Path(path).name)
    except ScheduleError as exc:
        raise ScheduleError(f"{str(path)!r}: {exc}") from None
    if forward_only:
        forward = (Kind.F, Kind.SEND_F, Kind.RECV_F)
        kept = {r: [a for a in row if a.kind in forward] for r, row in schedule.actions.items()}
        schedule = Schedule(
            schedule.num_stages,
            schedule.num_ranks,
            schedule.num_microbatches,
            kept,
            name=schedule.name,
            placement=schedule.placement,
        )
    return schedule
