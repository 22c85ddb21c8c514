"""Which rank failed first, and how to say it (pure)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RankFailure", "choose_root", "exit_status", "format_report", "read_error_file"]


@dataclass(frozen=True)
class RankFailure:
    """One process that ended badly, as far as the launcher could tell."""

    rank: int | None
    pid: int | None = None
    host: str | None = None
    exitcode: int | None = None
    """Exit status; negative: killed by that signal; None: unknown."""
    message: str = ""
    """``"RuntimeError: boom"`` when the process recorded an exception."""
    traceback: str = ""
    time: float | None = None
    """When the exception was recorded (seconds since the epoch)."""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


def read_error_file(path: str) -> dict[str, Any] | None:
    """The ``message`` part of a torch elastic error file, or None."""
    try:
        with open(path, encoding="utf-8") as fp:
            data = json.load(fp)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    return message if isinstance(message, dict) else None


def failure_from_record(
    record: Mapping[str, Any], *, rank: int | None, pid: int | None, exitcode: int | None
) -> RankFailure:
    """Combine a process's own error record with what its parent observed."""
    info = record.get("extraInfo", {}) if isinstance(record.get("extraInfo"), dict) else {}
    recorded_time = info.get("mpar_time")
    killed_by = info.get("mpar_signal")
    if isinstance(killed_by, int):  # written by the --mpi supervisor of a killed rank
        exitcode = -killed_by
    return RankFailure(
        rank=rank if rank is not None else info.get("mpar_rank"),
        pid=pid if pid is not None else info.get("mpar_pid"),
        host=info.get("mpar_host"),
        exitcode=exitcode,
        message="" if isinstance(killed_by, int) else str(record.get("message", "")),
        traceback=str(info.get("py_callstack", "")),
        time=float(recorded_time) if isinstance(recorded_time, (int, float)) else None,
    )


def _is_cleanup(failure: RankFailure) -> bool:
    """Stopped by the launcher after another rank failed (SIGTERM, nothing recorded)."""
    return failure.exitcode == -signal.SIGTERM and not failure.message


PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)
"""Words of an exception a rank raises because a peer's process went away: a
consequence of that peer's failure, not a cause (gloo's and NCCL's messages)."""


def _peer_gone(failure: RankFailure) -> bool:
    return any(words in failure.message for words in PEER_GONE)


def choose_root(failures: Iterable[RankFailure]) -> RankFailure:
    """The failure that most likely caused the others.

    Ranks stopped by the launcher's own SIGTERM are never the cause while another
    failure exists. mpar's hang report (``HangError``) comes first: it already
    names the rank that is behind, with its stack. Then a rank killed by a signal
    (SIGKILL, the OOM killer, SIGSEGV): its peers' errors are usually the broken
    connections it left. Then the earliest recorded exception that is not a lost
    connection to a peer (:data:`PEER_GONE`; a loaded machine can record such a
    consequence before the cause), then any exception, earliest first, then the
    lowest rank.
    """
    candidates = list(failures)
    if not candidates:
        raise ValueError("choose_root needs at least one failure")
    real = [f for f in candidates if not _is_cleanup(f)] or candidates

    def order(f: RankFailure) -> tuple[int, float, int]:
        killed = f.signal_name is not None and not f.message
        first = 0 if f.message.startswith("HangError:") else 1 if killed else 2
        first += 1 if first == 2 and _peer_gone(f) else 0
        return (first, f.time if f.time is not None else float("inf"), f.rank or 0)

    return min(real, key=order)


def describe(failure: RankFailure, *, max_message: int = 2000) -> str:
    who = "rank ?" if failure.rank is None else f"rank {failure.rank}"
    where = []
    if failure.pid is not None:
        where.append(f"pid {failure.pid}")
    if failure.host:
        where.append(f"on {failure.host}")
    if where:
        who += f" ({' '.join(where)})"
    if failure.message:
        message = failure.message.splitlines()[0] if failure.message.strip() else failure.message
        if len(message) > max_message:
            message = message[: max_message - 3] + "..."
        return f"{who} raised {message}"
    name = failure.signal_name
    if name == "SIGKILL":
        return f"{who} was killed by SIGKILL (kill -9, or the out-of-memory killer)"
    if name is not None:
        return f"{who} was killed by {name}"
    if failure.exitcode is not None:
        return f"{who} exited with code {failure.exitcode}"
    return f"{who} failed"


def format_report(failures: Iterable[RankFailure], *, launcher: str) -> str:
    """The text printed on the launcher's stderr when a job fails."""
    failures = list(failures)
    root = choose_root(failures)
    lines = [f"{launcher}: job failed: {describe(root)}"]
    if root.traceback:
        lines.append(f"{launcher}: traceback of rank {root.rank}:")
        lines.extend("  " + line for line in root.traceback.rstrip("\n").splitlines())
    # After a hang report the other ranks leave on their own, with nothing to say.
    hang = root.message.startswith("HangError:")

    def stopped_by_us(f: RankFailure) -> bool:
        return _is_cleanup(f) or (hang and not f.message)

    others = [f for f in failures if f is not root and not stopped_by_us(f)]
    stopped = sorted(
        f.rank for f in failures if f is not root and stopped_by_us(f) and f.rank is not None
    )
    lines.extend(f"{launcher}: also: {describe(f, max_message=120)}" for f in others)
    if stopped:
        lines.append(f"{launcher}: stopped the other ranks: {', '.join(map(str, stopped))}")
    return "\n".join(lines) + "\n"


def exit_status(failure: RankFailure) -> int:
    """The launcher's exit status for a failed job: 1 for an exception, 128 + signal
    for a rank killed by a signal (as shells do), else the rank's own status. A
    rank that recorded an exception and was then stopped by the launcher while
    it tore down (SIGTERM) failed by the exception: 1, not 143."""
    if failure.exitcode is None or failure.exitcode == 0:
        return 1
    if failure.message and failure.exitcode < 0:
        return 1
    if failure.exitcode < 0:
        return 128 - failure.exitcode
    return failure.exitcode
