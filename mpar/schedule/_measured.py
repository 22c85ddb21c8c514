"""Measured timelines beside simulated ones: ``mpar schedule --trace DIR``.

Each rank of a run with ``trace`` writes ``rank{R}.timeline.json``
(:mod:`mpar.runtime._timeline`): for its latest steps, every action's start
and end. :func:`compare` takes one pipeline's files (data-parallel replica
0), picks the latest step all of them recorded, and gives

* a Chrome/Perfetto trace with two processes: ``measured`` (one track per
  pipeline rank, real seconds from the step's start, every executed action,
  RECVs showing their waits) and ``simulated`` (the very schedule the ranks
  executed, recorded in their files, through :func:`mpar.schedule.simulate`,
  each stage's F, B, I and W costing the median of its measured durations);
* per rank: busy time (the stage's own computation) and bubble fraction,
  measured and simulated, and the step time of both (measured: first action's
  start to last action's end over the pipeline);
* the runtime's *overhead* per action kind: each action's time less its wait for
  a peer and less the stage's computation inside it (packing and sending,
  bookkeeping, hooks, the timeline itself), in µs per action. In the trace it is
  its own category (``overhead``): a slice of that length inside each action,
  at the action's start (its length is measured, not where in the action it fell).

Files written before computation was recorded separately count the whole action
less its wait as computation (their overhead shows as zero).

The simulation has no communication cost, so measured / simulated above 1 is
time lost to transfers, waits and the runtime's own work.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TypedDict

from mpar.errors import ScheduleError
from mpar.schedule._csv import is_csv_path, read_csv
from mpar.schedule._ir import Action, Schedule, ScheduleDict
from mpar.schedule._registry import executable_schedule, lower
from mpar.schedule._render import ChromeTrace, TraceEvent, to_chrome_trace
from mpar.schedule._simulate import SimulationResult, StageCosts, simulate

__all__ = ["Comparison", "Timeline", "compare", "overhead_by_kind"]

_COMPUTE = ("F", "B", "I", "W")

Entry = list[str | float]
"""One executed action: ``[text, start, end, waited, computed]`` (seconds; files of
older runs lack the last two)."""


class StepRecord(TypedDict):
    """One step of a rank's timeline."""

    step: int
    actions: list[Entry]


class Timeline(TypedDict, total=False):
    """One rank's timeline file (``mpar.runtime._timeline`` writes it)."""

    pp_rank: int
    dp_rank: int
    steps: list[StepRecord]
    schedule: ScheduleDict
    """The lowered schedule the ranks executed (files of older runs: the keys below)."""
    pipeline: str
    num_ranks: int
    microbatches: int
    virtual_stages: int
    active_microbatches: int | None
    forward_only: bool


@dataclass
class Comparison:
    """Measured and simulated step of one pipeline."""

    step: int
    measured_step_s: float
    simulated_step_s: float
    measured_busy_s: list[float]
    simulated_busy_s: list[float]
    trace: ChromeTrace = field(repr=False)
    overhead_us: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Action kind -> (actions of that kind in the step, median overhead in µs)."""

    def bubble(self, measured: bool = True) -> list[float]:
        busy = self.measured_busy_s if measured else self.simulated_busy_s
        total = self.measured_step_s if measured else self.simulated_step_s
        return [1.0 - b / total if total > 0 else 0.0 for b in busy]

    def report(self) -> str:
        lines = [
            f"step {self.step}: measured {self.measured_step_s * 1e3:.1f} ms, simulated "
            f"{self.simulated_step_s * 1e3:.1f} ms (measured / simulated "
            f"{self.measured_step_s / max(self.simulated_step_s, 1e-12):.2f})",
            "rank  busy ms  bubble (measured)  bubble (simulated)",
        ]
        for r, (busy, mb, sb) in enumerate(
            zip(self.measured_busy_s, self.bubble(True), self.bubble(False))
        ):
            lines.append(f"{r:<4}  {busy * 1e3:7.1f}  {mb:17.1%}  {sb:18.1%}")
        if self.overhead_us:
            lines.append("runtime overhead (outside compute and waits), median µs per action:")
            lines.append(
                "  " + ", ".join(f"{k} {us:.0f} (x{n})" for k, (n, us) in self.overhead_us.items())
            )
        return "\n".join(lines)


def compare(files: list[Timeline]) -> Comparison:
    """Merge the ranks' timeline files of one run (see the module docstring)."""
    ranks = _replica(files)
    step = _common_step(ranks)
    steps = {r["pp_rank"]: next(s for s in r["steps"] if s["step"] == step) for r in ranks}
    schedule = _schedule(ranks[0])
    if sorted(steps) != list(range(schedule.num_ranks)):
        raise ScheduleError(
            f"the trace has timelines of pipeline ranks {sorted(steps)} for replica 0; "
            f"expected 0..{schedule.num_ranks - 1}: was every rank's file written?"
        )
    result = simulate(schedule, _costs(steps, schedule.num_stages))
    t0 = min(float(a[1]) for s in steps.values() for a in s["actions"])
    t1 = max(float(a[2]) for s in steps.values() for a in s["actions"])
    measured_busy = [_busy(steps[r]["actions"]) for r in range(schedule.num_ranks)]
    simulated_busy = [float(b) for b in result.busy]
    trace = _trace(steps, t0, result)
    overhead = overhead_by_kind([s["actions"] for s in steps.values()])
    return Comparison(
        step, t1 - t0, result.makespan, measured_busy, simulated_busy, trace, overhead
    )


def _replica(files: list[Timeline]) -> list[Timeline]:
    ranks = [f for f in files if f.get("dp_rank", 0) == 0]
    if not ranks:
        raise ScheduleError("no timeline of data-parallel replica 0 in the trace directory")
    return sorted(ranks, key=lambda f: f["pp_rank"])


def _common_step(ranks: list[Timeline]) -> int:
    common = set.intersection(*({s["step"] for s in r["steps"]} for r in ranks))
    if not common:
        raise ScheduleError("the ranks' timelines share no step; were they written by one run?")
    return max(common)


def _schedule(meta: Timeline) -> Schedule:
    """The schedule the ranks executed: recorded in the timeline files, or (files of
    older runs) rebuilt from the config keys with the communication lowered."""
    if "schedule" in meta:
        return Schedule.from_dict(meta["schedule"])
    if is_csv_path(meta["pipeline"]):
        return lower(read_csv(meta["pipeline"], forward_only=meta.get("forward_only", False)))
    return executable_schedule(
        meta["pipeline"],
        meta["num_ranks"],
        meta["microbatches"],
        virtual_stages=meta["virtual_stages"],
        active_microbatches=meta.get("active_microbatches"),
        forward_only=meta.get("forward_only", False),
    )


def _split(entry: Entry) -> tuple[float, float, float]:
    """An action's (computed, waited, overhead) seconds from its timeline entry
    ``[text, start, end, waited?, computed?]`` (older files lack the last two)."""
    start, end = float(entry[1]), float(entry[2])
    waited = float(entry[3]) if len(entry) > 3 else 0.0
    if len(entry) > 4:
        computed = float(entry[4])
    else:
        compute = _action(entry).kind.value in _COMPUTE
        computed = end - start - waited if compute else 0.0
    return computed, waited, max(0.0, end - start - waited - computed)


def _action(entry: Entry) -> Action:
    return Action.parse(str(entry[0]))


def overhead_by_kind(actions_per_rank: list[list[Entry]]) -> dict[str, tuple[int, float]]:
    """Action kind -> (how many, median runtime overhead in µs) over the given ranks'
    actions of one step (``[text, start, end, waited, computed]`` each)."""
    per_kind: dict[str, list[float]] = {}
    for actions in actions_per_rank:
        for entry in actions:
            kind = _action(entry).kind.value
            per_kind.setdefault(kind, []).append(_split(entry)[2] * 1e6)
    return {k: (len(v), statistics.median(v)) for k, v in sorted(per_kind.items())}


def _costs(steps: dict[int, StepRecord], num_stages: int) -> StageCosts:
    durations: dict[tuple[int, str], list[float]] = {}
    for step in steps.values():
        for entry in step["actions"]:
            action = _action(entry)
            if action.kind.value in _COMPUTE:
                work = _split(entry)[0]
                durations.setdefault((action.stage, action.kind.value), []).append(work)

    def median(s: int, kind: str, default: float) -> float:
        values = durations.get((s, kind))
        return statistics.median(values) if values else default

    stages = range(num_stages)
    input_backward = [median(s, "I", 0.0) for s in stages]
    weight_backward = [median(s, "W", 0.0) for s in stages]
    backward = [median(s, "B", i + w) for s, i, w in zip(stages, input_backward, weight_backward)]
    return StageCosts(
        [median(s, "F", 0.0) for s in stages],
        backward,
        input_backward=input_backward,
        weight_backward=weight_backward,
    )


def _busy(actions: list[Entry]) -> float:
    """Seconds of the rank's own compute (older files: compute actions less their waits)."""
    return sum(_split(entry)[0] for entry in actions)


def _trace(steps: dict[int, StepRecord], t0: float, result: SimulationResult) -> ChromeTrace:
    events: list[TraceEvent] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "measured"}}
    ]
    for r, step in sorted(steps.items()):
        events.append(
            {"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": f"rank {r}"}}
        )
        for entry in step["actions"]:
            text, start, end = str(entry[0]), float(entry[1]), float(entry[2])
            action = _action(entry)
            computed, waited, overhead = _split(entry)
            event: TraceEvent = {"name": text, "cat": action.kind.value, "pid": 0, "tid": r}
            event["ts"] = (start - t0) * 1e6
            if end > start:  # a RECV's slice is its wait
                event.update(ph="X", dur=(end - start) * 1e6)
                event["args"] = {
                    "compute_us": computed * 1e6,
                    "wait_us": waited * 1e6,
                    "overhead_us": overhead * 1e6,
                }
            else:
                event.update(ph="i", s="t")
            events.append(event)
            if overhead > 0:
                events.append(
                    {
                        "name": f"{text} overhead",
                        "cat": "overhead",
                        "pid": 0,
                        "tid": r,
                        "ph": "X",
                        "ts": event["ts"],
                        "dur": overhead * 1e6,
                    }
                )
    for event in to_chrome_trace(result, time_unit_us=1e6)["traceEvents"]:
        event = dict(event, pid=1)
        if event.get("name") == "process_name":
            event["args"] = {"name": "simulated"}
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
