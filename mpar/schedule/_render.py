"""Renderers: text grid, Chrome trace JSON and PNG timeline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from mpar.schedule._ir import COMPUTE_KINDS, Kind, Schedule
from mpar.schedule._simulate import SimulationResult, TimedAction
from mpar.schedule._text_grid import format_grid

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["ChromeTrace", "TraceEvent", "render_png", "render_text", "to_chrome_trace"]

TraceEvent = dict[str, object]
"""One event of the Chrome trace format (``ph``, ``name``, ``ts``, ...)."""
Colour = tuple[float, float, float, float]
"""RGBA, each channel in [0, 1]."""


class ChromeTrace(TypedDict):
    """A Chrome trace (Perfetto opens it)."""

    traceEvents: list[TraceEvent]
    displayTimeUnit: str


_EPS = 1e-9


def render_text(subject: Schedule | SimulationResult, *, time_unit: float | None = None) -> str:
    """A rank x step grid (for a Schedule) or a rank x time grid (for a simulation).

    In the time grid each column is ``time_unit`` long (default: the shortest
    compute action, 1 with unit costs); an action shows its label in the
    column where it starts and ``~`` in the columns it still occupies; ``.``
    is idle. Communication and other zero-time actions are not drawn.
    """
    if isinstance(subject, Schedule):
        return subject.format_grid()
    unit = time_unit if time_unit is not None else _shortest(subject)
    if not unit > 0:
        raise ValueError(f"time_unit must be > 0, got {unit!r}")
    num_columns = math.ceil(subject.makespan / unit - _EPS)
    computed = [
        [t for t in subject.timeline[r] if t.end > t.start] for r in sorted(subject.timeline)
    ]
    width = max((len(str(t.action)) for row in computed for t in row), default=1)
    rows = [_time_row(row, unit, num_columns, width) for row in computed]
    labels = [f"rank {r}" for r in sorted(subject.timeline)]
    return format_grid(labels, rows, corner="time")


def _shortest(simulation: SimulationResult) -> float:
    durations = [t.end - t.start for row in simulation.timeline.values() for t in row]
    return min((d for d in durations if d > 0), default=1.0)


def _time_row(row: list[TimedAction], unit: float, num_columns: int, width: int) -> list[str]:
    cells = ["."] * num_columns
    for timed in row:
        first = math.floor(timed.start / unit + _EPS)
        stop = max(first + 1, math.ceil(timed.end / unit - _EPS))
        cells[first] = str(timed.action)
        for column in range(first + 1, min(stop, num_columns)):
            cells[column] = "~" * width
    return cells


def to_chrome_trace(simulation: SimulationResult, *, time_unit_us: float = 1000.0) -> ChromeTrace:
    """The simulated timeline as Chrome trace JSON (open it in Perfetto).

    One track per rank; compute actions are complete ("X") events, zero-time
    actions (sends, receives, UNSHARD, ...) instant events. One cost unit
    becomes ``time_unit_us`` microseconds (default: 1 unit = 1 ms).
    """
    schedule = simulation.schedule
    events: list[TraceEvent] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": _title(simulation)}}
    ]
    for rank in sorted(simulation.timeline):
        events.append(
            {
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "name": "thread_name",
                "args": {"name": f"rank {rank}"},
            }
        )
        for timed in simulation.timeline[rank]:
            events.append(_trace_event(timed, schedule.num_ranks, time_unit_us))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _trace_event(timed: TimedAction, num_ranks: int, time_unit_us: float) -> TraceEvent:
    action = timed.action
    event: TraceEvent = {
        "name": str(action),
        "cat": action.kind.value,
        "pid": 0,
        "tid": timed.rank,
        "ts": timed.start * time_unit_us,
        "args": {
            "stage": action.stage,
            "chunk": action.stage // num_ranks,
            "microbatch": action.microbatch,
        },
    }
    if timed.end > timed.start:
        event.update(ph="X", dur=(timed.end - timed.start) * time_unit_us)
    else:
        event.update(ph="i", s="t")
    return event


def _title(simulation: SimulationResult) -> str:
    schedule = simulation.schedule
    return (
        f"{schedule.name or 'schedule'}: p={schedule.num_ranks}, v={schedule.virtual_stages}, "
        f"m={schedule.num_microbatches}; makespan {simulation.makespan:g}, "
        f"bubble {100 * simulation.bubble_fraction:.1f}%"
    )


def render_png(simulation: SimulationResult, path: str | Path, *, dpi: int = 150) -> Path:
    """Draw the timeline to a PNG: ranks as rows, actions coloured by microbatch.

    Forwards are light, backwards dark (I and W hatched). Needs matplotlib
    (``pip install 'mpar[plot]'``); it is imported only here.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "render_png needs matplotlib, which is not installed: "
            "pip install 'mpar[plot]' (or pip install matplotlib)"
        ) from error
    colours = _microbatch_colours(simulation.schedule.num_microbatches)
    width = min(24.0, max(7.0, 0.22 * simulation.makespan + 2.0))
    figure = Figure(figsize=(width, 0.55 * simulation.schedule.num_ranks + 2.0))
    axes = figure.add_subplot()
    for row in simulation.timeline.values():
        for timed in row:
            if timed.action.kind in COMPUTE_KINDS and timed.end > timed.start:
                _draw_action(axes, timed, colours)
    _decorate(axes, simulation, colours)
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target, dpi=dpi)
    return target


def _decorate(axes: Axes, simulation: SimulationResult, colours: list[Colour]) -> None:
    """Axes limits, rank labels, title and a legend of microbatch colours."""
    from matplotlib.patches import Patch

    p = simulation.schedule.num_ranks
    axes.set_xlim(0, max(simulation.makespan, 1.0))
    axes.set_ylim(p - 0.5, -0.5)
    axes.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    axes.set_xlabel("time (cost units)")
    axes.set_title(_title(simulation), fontsize=10)
    axes.grid(axis="x", alpha=0.25)
    handles = [Patch(facecolor=colour, label=f"mb {j}") for j, colour in enumerate(colours[:16])]
    handles.append(Patch(facecolor=_lighten((0.5, 0.5, 0.5)), edgecolor="black", label="F (light)"))
    handles.append(Patch(facecolor=(0.5, 0.5, 0.5), edgecolor="black", label="B (dark)"))
    axes.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=min(len(handles), 10),
        fontsize=8,
        frameon=False,
    )


def _draw_action(axes: Axes, timed: TimedAction, colours: list[Colour]) -> None:
    action = timed.action
    base = colours[(action.microbatch or 0) % len(colours)]
    face = _lighten(base) if action.kind in (Kind.F, Kind.W) else base
    hatch = "//" if action.kind in (Kind.I, Kind.W) else None
    duration = timed.end - timed.start
    axes.barh(
        timed.rank,
        duration,
        left=timed.start,
        height=0.8,
        color=face,
        edgecolor="black",
        linewidth=0.5,
        hatch=hatch,
    )
    text_colour = "black" if action.kind in (Kind.F, Kind.W) else "white"
    axes.text(
        timed.start + duration / 2,
        timed.rank,
        str(action),
        ha="center",
        va="center",
        fontsize=7,
        color=text_colour,
        clip_on=True,
    )


def _microbatch_colours(num_microbatches: int) -> list[Colour]:
    from matplotlib import colormaps

    name = "tab10" if num_microbatches <= 10 else "tab20"
    cmap = colormaps[name]
    return [cmap(j % cmap.N) for j in range(min(num_microbatches, cmap.N))]


def _lighten(colour: Sequence[float], amount: float = 0.55) -> Colour:
    red, green, blue = (channel + (1 - channel) * amount for channel in colour[:3])
    return (red, green, blue, 1.0)
