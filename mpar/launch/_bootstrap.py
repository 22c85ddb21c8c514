"""Child-side entry of ``mpar launch``: run the user's script and record its failure.

Every process the launcher starts runs ``python -u <this file> script.py args...``.
This file is executed by path, not imported as part of ``mpar``, so it uses the
standard library only and starts without importing torch or mpar. It

1. makes the process look as if ``python script.py args...`` had been run:
   ``sys.argv``, ``sys.path[0]`` (the script's folder) and ``__main__``;
2. on an uncaught exception, prints ``[mpar-launch] rank R ... failed`` and a
   traceback trimmed to the user's frames on stderr, writes it to the error
   file torch elastic asks for (``TORCHELASTIC_ERROR_FILE``, the JSON layout of
   ``torch.distributed.elastic.multiprocessing.errors``) and, under ``--mpi``,
   to the launcher's run folder; then calls ``MPI_Abort`` when the script had
   initialised MPI (a plain exit would hang in ``MPI_Finalize``) and exits 1;
3. once mpar's hang watchdog has reported (``MPAR_HANG_REPORTED=1``), treats an
   uncaught exception as that report's consequence (a peer left): exits 1 at
   once and quietly. The watchdog records its report with :func:`record_failure`.

``SystemExit`` and ``KeyboardInterrupt`` pass through unchanged (a non-zero
``SystemExit`` is reported like an exception first). Under ``--mpi`` each rank
also notes its pid at start and its normal exit in the launcher's run folder, so
that the launcher can tell which rank was killed by a signal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from types import TracebackType

# The launcher's --mpi mode watches stderr for this prefix to stop the job early.
FAILURE_MARKER = "[mpar-launch] rank"
RUNDIR_ENV = "MPAR_LAUNCH_RUNDIR"
SUPERVISE_ENV = "MPAR_LAUNCH_SUPERVISE"
HANG_REPORTED_ENV = "MPAR_HANG_REPORTED"  # set by mpar's hang watchdog once it reports
BOOTSTRAP_PATH = os.path.abspath(__file__)
_RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def process_rank() -> int | None:
    """This process's global rank, from torchrun, MPI or SLURM variables."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _user_traceback(exc: BaseException, script: str) -> str:
    """The traceback of ``exc`` starting at the user's script (runpy frames removed)."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _write_json_atomically(path: str, data: Mapping[str, object]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
        os.replace(tmp, path)
    except OSError:
        pass  # reporting must never hide the original error


def _error_record(message: str, text: str, rank: int | None) -> dict[str, object]:
    now = time.time()
    return {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": text,
                "timestamp": str(int(now)),
                "mpar_time": now,
                "mpar_rank": rank,
                "mpar_pid": os.getpid(),
                "mpar_host": socket.gethostname(),
            },
        }
    }


def _rundir() -> str | None:
    path = os.environ.get(RUNDIR_ENV)
    return path if path and os.path.isdir(path) else None


def _record_start(rank: int | None) -> None:
    """Under --mpi, note rank -> pid so the launcher can name a rank killed by a signal."""
    rundir = _rundir()
    if rundir is None or rank is None:
        return
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
    _write_json_atomically(os.path.join(rundir, f"rank{rank}.start.json"), record)


def _record_exit(code: object) -> None:
    """Under --mpi, note a normal exit: the launcher then knows this rank was not killed."""
    rundir, rank = _rundir(), process_rank()
    if rundir is not None and rank is not None:
        record = {"rank": rank, "pid": os.getpid(), "code": code if isinstance(code, int) else 1}
        _write_json_atomically(os.path.join(rundir, f"rank{rank}.exit.json"), record)


def _report_failure(exc: BaseException, script: str) -> None:
    if isinstance(exc, SystemExit):
        text = f"SystemExit: {exc.code}\n"
    else:
        text = _user_traceback(exc, script)
    record_failure(f"{type(exc).__name__}: {exc}", text)


def record_failure(message: str, text: str) -> None:
    """Report this rank's failure: ``text`` on stderr after the launcher's marker line,
    and ``message`` + ``text`` in torch elastic's error file and ``--mpi``'s run folder.

    Also used by mpar's hang watchdog, whose report is not an exception.
    """
    rank = process_rank()
    who = "?" if rank is None else str(rank)
    header = f"{FAILURE_MARKER} {who} (pid {os.getpid()} on {socket.gethostname()}) failed:"
    sys.stderr.write(f"{header}\n{text}")
    sys.stderr.flush()
    record = _error_record(message, text, rank)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        _write_json_atomically(error_file, record)
    rundir = _rundir()
    if rundir is not None and rank is not None:
        _write_json_atomically(os.path.join(rundir, f"rank{rank}.error.json"), record)


def _abort_mpi_if_initialized() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(1)
    except Exception:
        pass


def _report_killed(child_pid: int, signum: int) -> None:
    rank = process_rank()
    name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
    who = "?" if rank is None else str(rank)
    host = socket.gethostname()
    sys.stderr.write(
        f"{FAILURE_MARKER} {who} (pid {child_pid} on {host}) failed: killed by {name}\n"
    )
    sys.stderr.flush()
    rundir = _rundir()
    if rundir is not None and rank is not None:
        now = time.time()
        record = {
            "message": {
                "message": f"killed by {name}",
                "extraInfo": {
                    "py_callstack": "",
                    "timestamp": str(int(now)),
                    "mpar_time": now,
                    "mpar_rank": rank,
                    "mpar_pid": child_pid,
                    "mpar_host": host,
                    "mpar_signal": signum,
                },
            }
        }
        _write_json_atomically(os.path.join(rundir, f"rank{rank}.error.json"), record)


def supervise(argv: list[str]) -> int:
    """Run the rank as a child (inheriting MPI's fds) and report how it ended.

    Signals sent to this process are passed on to the rank. A rank killed by a
    signal nobody forwarded (kill -9, the OOM killer, a segfault) is reported;
    then this process dies by the same signal so that mpiexec stops the job.
    """
    env = dict(os.environ)
    env[SUPERVISE_ENV] = "0"
    child = subprocess.Popen(
        [sys.executable, "-u", BOOTSTRAP_PATH, *argv], env=env, close_fds=False
    )
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    code = child.wait()
    if code >= 0:
        return code
    if not forwarded:
        _report_killed(child.pid, -code)
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    return 128 - code


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python _bootstrap.py script.py [args...]\n")
        return 2
    if os.environ.get(SUPERVISE_ENV) == "1":
        return supervise(argv)
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    faulthandler.enable(all_threads=True)
    _record_start(process_rank())
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _report_failure(exc, script)
        _record_exit(exc.code)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if os.environ.get(HANG_REPORTED_ENV) == "1":  # a consequence of the hang report
            os._exit(1)  # now, without the interpreter's teardown (it may abort)
        _report_failure(exc, script)
        _abort_mpi_if_initialized()
        return 1
    _record_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
