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
from typing import Any

from mpar.comm._lifecycle import on_shutdown

__all__ = ["KEEP", "StepTimeline", "write_timeline"]

KEEP = 8
"""Steps each rank keeps in its timeline file (the latest ones)."""

_STEPS: list[dict[str, Any]] = []
on_shutdown(_STEPS.clear)


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
        self.actions: list[tuple[str, float, float, float, float]] = []


def write_timeline(
    trace_dir: str,
    step: int,
    timeline: StepTimeline,
    layout: dict[str, Any],
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
