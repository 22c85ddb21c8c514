"""Pipeline schedules as data: IR, generators, validation, simulation, rendering.

Pure Python: nothing here imports torch. A schedule is, for every rank, an
ordered list of ``Action``s such as ``1F3`` (stage 1, forward, microbatch 3)::

    from mpar.schedule import build_schedule, simulate, render_text

    schedule = build_schedule("interleaved", 4, 8, virtual_stages=2)
    result = simulate(schedule)
    print(render_text(result), result.bubble_fraction)
"""

from __future__ import annotations

from mpar.schedule._csv import read_csv, schedule_from_csv, schedule_to_csv, write_csv
from mpar.schedule._generators import interleaved, least_active_microbatches, simple
from mpar.schedule._ir import (
    COMMUNICATION_KINDS,
    COMPUTE_KINDS,
    PLACEMENTS,
    Action,
    Kind,
    Schedule,
    stage_rank,
)
from mpar.schedule._lower import lower_communication
from mpar.schedule._p2p_order import check_p2p_order, receive_posts
from mpar.schedule._registry import (
    PIPELINES,
    SCHEDULE_HELP,
    build_schedule,
    executable_schedule,
    lower,
    placement_of,
)
from mpar.schedule._render import render_png, render_text, to_chrome_trace
from mpar.schedule._shard_lower import lower_sharding
from mpar.schedule._simulate import (
    SimulationResult,
    StageCosts,
    TimedAction,
    peak_in_flight,
    simulate,
)
from mpar.schedule._validate import validate
from mpar.schedule._zero_bubble import zbv, zero_bubble, zero_bubble_allowance, zero_bubble_peak

__all__ = [
    "COMMUNICATION_KINDS",
    "COMPUTE_KINDS",
    "PIPELINES",
    "PLACEMENTS",
    "SCHEDULE_HELP",
    "Action",
    "Kind",
    "Schedule",
    "SimulationResult",
    "StageCosts",
    "TimedAction",
    "build_schedule",
    "check_p2p_order",
    "executable_schedule",
    "interleaved",
    "least_active_microbatches",
    "lower",
    "lower_communication",
    "lower_sharding",
    "peak_in_flight",
    "placement_of",
    "read_csv",
    "receive_posts",
    "render_png",
    "render_text",
    "schedule_from_csv",
    "schedule_to_csv",
    "simple",
    "simulate",
    "stage_rank",
    "to_chrome_trace",
    "validate",
    "write_csv",
    "zbv",
    "zero_bubble",
    "zero_bubble_allowance",
    "zero_bubble_peak",
]
