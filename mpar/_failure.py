"""How a rank records its failure for launchers (a leaf: standard library only).

A failing rank prints ``[mpar-launch] rank R (pid P on HOST) failed:`` and its
text on stderr (``mpar launch --mpi`` watches for that line), and writes a JSON
record in the layout of ``torch.distributed.elastic.multiprocessing.errors`` to
the error file torch elastic names and to ``mpar launch --mpi``'s run folder.
The launcher's child entry (``mpar/launch/_child.py``, which loads this
file by path so that it starts without importing torch) records uncaught
exceptions with it; the hang watchdog (``mpar.comm``) records its report.
Callers pass where to write: this module reads no environment.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping

__all__ = [
    "FAILURE_MARKER",
    "RUNDIR_ENV",
    "error_record",
    "record_failure",
    "write_json_atomically",
]

FAILURE_MARKER = "[mpar-launch] rank"
"""The prefix of a failing rank's stderr line; the launcher's --mpi mode stops the job on it."""
RUNDIR_ENV = "MPAR_LAUNCH_RUNDIR"
"""The variable naming ``mpar launch --mpi``'s run folder (set by the launcher)."""


def write_json_atomically(path: str, data: Mapping[str, object]) -> None:
    """Write ``data`` to ``path`` through a temporary file; never raises."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
        os.replace(tmp, path)
    except OSError:
        pass  # reporting must never hide the original error


def error_record(
    message: str, text: str, rank: int | None, *, pid: int | None = None, **extra: object
) -> dict[str, object]:
    """torch elastic's error-file record; ``extra`` goes into its ``extraInfo``."""
    now = time.time()
    return {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": text,
                "timestamp": str(int(now)),
                "mpar_time": now,
                "mpar_rank": rank,
                "mpar_pid": os.getpid() if pid is None else pid,
                "mpar_host": socket.gethostname(),
                **extra,
            },
        }
    }


def record_failure(
    message: str, text: str, *, rank: int | None, error_file: str | None, run_dir: str | None
) -> None:
    """Report this rank's failure: ``text`` on stderr after the launcher's marker line,
    and ``message`` + ``text`` in torch elastic's ``error_file`` and in ``run_dir``
    (``rank{R}.error.json``, read by ``mpar launch --mpi``), where given."""
    who = "?" if rank is None else str(rank)
    header = f"{FAILURE_MARKER} {who} (pid {os.getpid()} on {socket.gethostname()}) failed:"
    sys.stderr.write(f"{header}\n{text}")
    sys.stderr.flush()
    record = error_record(message, text, rank)
    if error_file:
        write_json_atomically(error_file, record)
    if run_dir is not None and rank is not None and os.path.isdir(run_dir):
        write_json_atomically(os.path.join(run_dir, f"rank{rank}.error.json"), record)
