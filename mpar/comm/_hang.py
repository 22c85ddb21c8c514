"""Which rank is behind, and the hang report (pure: snapshots in, text out).

A *snapshot* is what one rank's watchdog published when asked (a JSON dict):
``rank``, ``pid``, ``host``, ``time`` (its clock when it answered), ``step``,
``in_step``, ``action`` (text or None), ``last`` (time of its last progress),
``wait`` (None, or ``text``, ``kind``, ``name``, ``peers`` and ``since``),
``recent`` (its flight recorder: ``[time, step, event]`` rows, oldest first)
and ``stacks`` (every thread's Python stack). A rank that did not answer has
no snapshot.

The rank *behind* is one that others wait for and that is not waiting itself
(it computes, sleeps, loads data, or does not answer). When every rank waits,
the job is deadlocked; a rank inside a collective that some of its group has
not entered (an extra ``barrier`` on one rank) is then the one to blame.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Verdict", "diagnose", "format_report", "position"]

Snapshot = Mapping[str, Any]
_RECENT_IN_REPORT = 12
_OTHERS_IN_DETAIL = 4
"""Other ranks whose stacks the report shows (large jobs: positions only for the rest)."""


@dataclass(frozen=True)
class Verdict:
    """The diagnosis of one hang."""

    culprit: int
    """The rank that is behind (the one to look at)."""
    deadlock: bool
    """True when every rank waits (no rank is simply slow)."""
    waiters: dict[int, list[int]]
    """Each waiting rank -> the ranks it waits for."""
    message: str
    """One line: what happened, for the launcher's summary."""


def _same_collective(a: Snapshot, b: Snapshot) -> bool:
    wa, wb = a.get("wait"), b.get("wait")
    if not wa or not wb or wa["kind"] != "collective" or wb["kind"] != "collective":
        return False
    return bool(wa["name"] == wb["name"] and wa["peers_all"] == wb["peers_all"])


def _waits_for(snaps: Mapping[int, Snapshot]) -> dict[int, list[int]]:
    """Each waiting rank -> the peers it waits for (collective partners excluded)."""
    found: dict[int, list[int]] = {}
    for rank, snap in snaps.items():
        wait = snap.get("wait")
        if not wait:
            continue
        peers = [int(p) for p in wait["peers"]]
        if wait["kind"] == "collective":
            peers = [p for p in peers if p not in snaps or not _same_collective(snap, snaps[p])]
        if peers:
            found[rank] = peers
    return found


def _oldest(ranks: list[int], snaps: Mapping[int, Snapshot], *, waiting: bool) -> int:
    """The rank idle the longest (``waiting``: waiting the longest); a silent one first."""

    def age(rank: int) -> tuple[int, float, int]:
        snap = snaps.get(rank)
        if snap is None:  # did not answer: the likeliest to be behind
            return (0, 0.0, rank)
        since = snap["wait"]["since"] if waiting else snap["last"]
        return (1, float(since) - float(snap["time"]), rank)

    return min(ranks, key=age)


_SHUTDOWN = "mpar.shutdown"
"""In the name of the final barrier's wait (``comm._lifecycle``)."""


def diagnose(snaps: Mapping[int, Snapshot], world_size: int, trigger: Mapping[str, Any]) -> Verdict:
    """Name the rank that is behind. ``trigger`` is the request of the rank that
    waited too long: its ``rank`` and its ``wait`` (as in a snapshot)."""
    snaps = dict(snaps)
    waiters = _waits_for(snaps)
    if not waiters and trigger.get("wait"):  # the trigger's wait ended while we asked
        waiters = {int(trigger["rank"]): [int(p) for p in trigger["wait"]["peers"]]}
    waited_for = sorted({p for peers in waiters.values() for p in peers})
    idle = [p for p in waited_for if p not in waiters]
    if idle:
        culprit = _oldest(idle, snaps, waiting=False)
        return Verdict(culprit, False, waiters, _stuck_message(culprit, snaps, waiters))
    if not waiters:  # nothing known to wait: blame the rank that asked
        culprit = int(trigger["rank"])
        return Verdict(culprit, False, waiters, f"rank {culprit} waited longer than timeout_s")
    mismatched = [r for r, s in snaps.items() if r in waiters and s["wait"]["kind"] == "collective"]
    leaving = [r for r in mismatched if _SHUTDOWN in str(snaps[r]["wait"].get("name"))]
    if leaving and len(leaving) < len(waiters):  # at the end while its peers still work
        mismatched = leaving
    culprit = _oldest(mismatched or list(waiters), snaps, waiting=True)
    return Verdict(culprit, True, waiters, _deadlock_message(culprit, snaps, waiters))


def _who_waits(culprit: int, waiters: Mapping[int, list[int]]) -> str:
    ranks = sorted(r for r, peers in waiters.items() if culprit in peers)
    if not ranks:
        return ""
    names = ", ".join(map(str, ranks))
    return (
        f"; rank{'s' if len(ranks) > 1 else ''} {names} wait{'' if len(ranks) > 1 else 's'} for it"
    )


def _stuck_message(
    culprit: int, snaps: Mapping[int, Snapshot], waiters: Mapping[int, list[int]]
) -> str:
    snap = snaps.get(culprit)
    if snap is None:
        return f"rank {culprit} made no progress and did not answer{_who_waits(culprit, waiters)}"
    idle = float(snap["time"]) - float(snap["last"])
    return (
        f"rank {culprit} made no progress for {idle:.1f} s ({position(snap, brief=True)})"
        f"{_who_waits(culprit, waiters)}"
    )


def _deadlock_message(
    culprit: int, snaps: Mapping[int, Snapshot], waiters: Mapping[int, list[int]]
) -> str:
    wait = snaps[culprit]["wait"]
    if _SHUTDOWN in str(wait.get("name")):
        absent = ", ".join(map(str, waiters[culprit]))
        head = (
            f"deadlock: rank {culprit} waits in {wait['name']} (it reached the end of its "
            f"script early, or skipped work) while rank(s) {absent} still run"
        )
    elif wait["kind"] == "collective":
        absent = ", ".join(map(str, waiters[culprit]))
        head = (
            f"deadlock: rank {culprit} waits in {wait['name']}, which rank(s) {absent} did not call"
        )
    else:
        head = f"deadlock: rank {culprit} waits for {wait['text']}"
    others = [f"rank {r} waits for {snaps[r]['wait']['text']}" for r in sorted(waiters)]
    others = [o for r, o in zip(sorted(waiters), others) if r != culprit]
    return "; ".join([head, *others])


def position(snap: Snapshot, *, brief: bool = False) -> str:
    """Where one rank is, in words (ages on its own clock)."""
    now = float(snap["time"])
    step, action = snap.get("step", -1), snap.get("action")
    where = f"step {step}, action {action}"
    if action is None:  # the first step partitions; stage 0 runs the step function up to model()
        where = f"step {step}, before its first action (partitioning, or the step function)"
    if not snap.get("in_step"):
        where = "before its first step" if step < 0 else f"between steps, after step {step}"
    if snap.get("inside") and not snap.get("wait"):
        where += f", inside {snap['inside']}"
    wait = snap.get("wait")
    if wait:
        text = f"waiting {now - float(wait['since']):.1f} s for {wait['text']}"
        return text if brief else f"{text} ({where})"
    if brief:
        return where
    return f"{where}; last progress {now - float(snap['last']):.1f} s ago"


def _recent_lines(snap: Snapshot) -> list[str]:
    now = float(snap["time"])
    rows = snap.get("recent", [])[-_RECENT_IN_REPORT:]
    return [f"    {now - float(t):7.2f} s ago  step {step}  {event}" for t, step, event in rows]


def _indent(text: str, prefix: str = "    ") -> list[str]:
    return [prefix + line for line in text.rstrip("\n").splitlines()]


def _rank_block(rank: int, snap: Snapshot | None, *, detail: str) -> list[str]:
    """One rank's part of the report; ``detail``: "full" (every thread), "main" or "none"."""
    if snap is None:
        return [
            f"rank {rank}: did not answer (its process may be stopped, or a C call holds "
            "the Python interpreter lock)"
        ]
    lines = [f"rank {rank} (pid {snap['pid']} on {snap['host']}): {position(snap)}"]
    if detail == "none":
        return lines
    stacks = snap.get("stacks" if detail == "full" else "main_stack") or ""
    if stacks:
        lines.append("  stack:" if detail == "full" else "  main thread:")
        lines.extend(_indent(stacks))
    if snap.get("recent"):
        lines.append("  last events (flight recorder, newest last):")
        lines.extend(_recent_lines(snap))
    return lines


def _detailed_ranks(verdict: Verdict, world_size: int) -> set[int]:
    """The other ranks shown with stacks: those waiting for the culprit first, at most
    :data:`_OTHERS_IN_DETAIL` (every rank's position is always shown)."""
    direct = [r for r, peers in sorted(verdict.waiters.items()) if verdict.culprit in peers]
    rest = [r for r in range(world_size) if r != verdict.culprit and r not in direct]
    return set((direct + rest)[:_OTHERS_IN_DETAIL])


def format_report(
    verdict: Verdict, snaps: Mapping[int, Snapshot], world_size: int, timeout_s: float
) -> str:
    """The whole hang report: the culprit first, with its stack; then every other rank."""
    lines = [
        f"mpar: hang detected (a rank waited more than timeout_s={timeout_s:g} s): "
        f"{verdict.message}",
        "",
    ]
    if not verdict.deadlock:
        lines.append(
            f"If rank {verdict.culprit} is only slow (the first step profiles and partitions "
            "the model; a long evaluation or save on one rank), raise timeout_s."
        )
        lines.append("")
    lines.append(f"--- rank {verdict.culprit}, the one that is behind ---")
    lines.extend(_rank_block(verdict.culprit, snaps.get(verdict.culprit), detail="full"))
    detailed = _detailed_ranks(verdict, world_size)
    for rank in range(world_size):
        if rank != verdict.culprit:
            lines.append("")
            lines.append(f"--- rank {rank} ---")
            detail = "main" if rank in detailed else "none"
            lines.extend(_rank_block(rank, snaps.get(rank), detail=detail))
    return "\n".join(lines) + "\n"
