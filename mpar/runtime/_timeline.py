"""The measured timeline: each executed action's start and end, per rank, with ``trace``.

With the ``trace`` config key (or ``MPAR_TRACE``) set to a directory, every rank
times each action of its schedule (wall clock, ``time.time()``: ranks of one
host share it; across hosts the clocks' offset shows up as a shift) and, after
each step, rewrites ``{trace}/rank{R}.timeline.json`` with its last
:data:`KEEP` steps. ``mpar schedule --trace {trace}`` merges the ranks' files
into one Perfetto trace beside the simulated schedule
(:mod:`mpar.schedule._measured`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypedDict

from mpar.comm import _process_state
from mpar.schedule._ir import ScheduleDict

__all__ = ["KEEP", "StepTimeline", "TimedAction", "TraceLayout", "write_timeline"]

KEEP = 8
"""Steps each rank keeps in its timeline file (the latest ones)."""

TimedAction = tuple[str, float, float, float, float]
"""An executed action: ``(text, start, end, waited, computed)``."""


class TraceLayout(TypedDict):
    """What ``mpar schedule --trace`` needs to rebuild and simulate a rank's schedule."""

    rank: int
    pp_rank: int
    dp_rank: int
    pipeline: str
    num_ranks: int
    virtual_stages: int
    microbatches: int
    active_microbatches: int | None
    forward_only: bool
    schedule: ScheduleDict
    """The lowered schedule the ranks executed (``Schedule.to_dict``)."""


class _TimedStep(TypedDict):
    step: int
    start: float
    end: float
    actions: list[TimedAction]


_STEPS: list[_TimedStep] = []
"""This rank's latest :data:`KEEP` timed steps (process state: cleared by ``shutdown``)."""
_process_state.register("mpar.runtime._timeline._STEPS", _STEPS.clear, lambda: not _STEPS)


class StepTimeline:
    """The actions of one step on this rank: ``[text, start, end, waited, computed]`` each.

    ``waited``: seconds of the action spent blocked on a receive from a peer;
    ``computed``: seconds spent in the stage's own computation (its forward, its
    backward or weight-gradient autograd call, and on the last stage the user's step
    function outside ``model(...)``). The rest of the action, ``end - start - waited
    - computed``, is the runtime's overhead: packing, sending, bookkeeping, hooks,
    this timeline. ``waited`` and ``computed`` are running totals over the step; the
    executor records their growth over each action.
    """

    __slots__ = ("actions", "computed", "end", "start", "waited")

    def __init__(self, start: float) -> None:
        self.start = start
        self.end = start
        self.waited = 0.0
        self.computed = 0.0
        self.actions: list[TimedAction] = []


def write_timeline(
    trace_dir: str,
    step: int,
    timeline: StepTimeline,
    layout: TraceLayout,
) -> None:
    """Add one step to this rank's file (best effort: tracing never fails a step)."""
    _STEPS.append(
        {"step": step, "start": timeline.start, "end": timeline.end, "actions": timeline.actions}
    )
    del _STEPS[:-KEEP]
    rank = layout["rank"]
    try:
        folder = Path(trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank{rank}.timeline.json.tmp"
        tmp.write_text(json.dumps({**layout, "steps": _STEPS}))
        os.replace(tmp, folder / f"rank{rank}.timeline.json")
    except OSError:
        pass
