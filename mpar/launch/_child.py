"""Child-side entry of ``mpar launch``: run the user's script and record its failure.

Every process the launcher starts runs ``python -u <this file> script.py args...``.
This file is executed by path, not imported as part of ``mpar``, so it uses the
standard library only and starts without importing torch or mpar (the failure
record, ``mpar/_failure.py``, a standard-library leaf, is loaded by path). It

1. makes the process look as if ``python script.py args...`` had been run:
   ``sys.argv``, ``sys.path[0]`` (the script's folder) and ``__main__``;
2. on an uncaught exception, prints ``[mpar-launch] rank R ... failed`` and a
   traceback trimmed to the user's frames on stderr, writes it to the error
   file torch elastic asks for (``TORCHELASTIC_ERROR_FILE``, the JSON layout of
   ``torch.distributed.elastic.multiprocessing.errors``) and, under ``--mpi``,
   to the launcher's run folder; then calls ``MPI_Abort`` when the script had
   initialised MPI (a plain exit would hang in ``MPI_Finalize``) and exits 1;
3. once mpar's hang watchdog has reported (its ``HANG_REPORTED`` event is set),
   treats an uncaught exception as that report's consequence (a peer left):
   exits 1 at once and quietly. The watchdog records its report with the same
   ``mpar/_failure.py``.

Each process dies with its parent (Linux's parent-death signal): SIGKILL of
``mpar launch`` leaves no worker behind. ``SystemExit`` and
``KeyboardInterrupt`` pass through unchanged (a non-zero
``SystemExit`` is reported like an exception first). Under ``--mpi`` each rank
also notes its pid at start and its normal exit in the launcher's run folder, so
that the launcher can tell which rank was killed by a signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib.util
import os
import runpy
import signal
import socket
import subprocess
import sys
import traceback
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING

SUPERVISE_ENV = "MPAR_LAUNCH_SUPERVISE"
BOOTSTRAP_PATH = os.path.abspath(__file__)


def _load_failure_module() -> ModuleType:
    """``mpar/_failure.py``, loaded by path: importing ``mpar`` would import torch."""
    path = os.path.join(os.path.dirname(os.path.dirname(BOOTSTRAP_PATH)), "_failure.py")
    spec = importlib.util.spec_from_file_location("_mpar_failure", path)
    assert spec is not None and spec.loader is not None  # the file ships beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    import mpar._failure as _failure
else:
    _failure = _load_failure_module()
FAILURE_MARKER = _failure.FAILURE_MARKER
RUNDIR_ENV = _failure.RUNDIR_ENV
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


def _rundir() -> str | None:
    path = os.environ.get(RUNDIR_ENV)
    return path if path and os.path.isdir(path) else None


def _record_start(rank: int | None) -> None:
    """Under --mpi, note rank -> pid so the launcher can name a rank killed by a signal."""
    rundir = _rundir()
    if rundir is None or rank is None:
        return
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
    _failure.write_json_atomically(os.path.join(rundir, f"rank{rank}.start.json"), record)


def _record_exit(code: object) -> None:
    """Under --mpi, note a normal exit: the launcher then knows this rank was not killed."""
    rundir, rank = _rundir(), process_rank()
    if rundir is not None and rank is not None:
        record = {"rank": rank, "pid": os.getpid(), "code": code if isinstance(code, int) else 1}
        _failure.write_json_atomically(os.path.join(rundir, f"rank{rank}.exit.json"), record)


def _argparse_message(exc: SystemExit) -> str | None:
    """The message argparse printed before raising ``exc`` (its ``exit`` frame's), if any:
    a script's bad command line then reads as such in the launcher's summary."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "exit" and frame.f_code.co_filename.endswith("argparse.py"):
            message = frame.f_locals.get("message")
            return message.strip() if isinstance(message, str) and message.strip() else None
        tb = tb.tb_next
    return None


def _report_failure(exc: BaseException, script: str) -> None:
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SystemExit):
        usage = _argparse_message(exc)
        message += f" ({usage})" if usage else ""
        text = f"{message}\n"
    else:
        text = _user_traceback(exc, script)
    record_failure(message, text)


def record_failure(message: str, text: str) -> None:
    """Report this rank's failure on stderr, in torch elastic's error file and in
    ``--mpi``'s run folder (see ``mpar/_failure.py``)."""
    _failure.record_failure(
        message,
        text,
        rank=process_rank(),
        error_file=os.environ.get("TORCHELASTIC_ERROR_FILE"),
        run_dir=_rundir(),
    )


def _hang_reported() -> bool:
    """Whether mpar's hang watchdog has reported (its module is loaded in mpar jobs only)."""
    watchdog = sys.modules.get("mpar.comm._watchdog")
    return watchdog is not None and bool(watchdog.HANG_REPORTED.is_set())


def _mark_mpar_failed() -> None:
    """Tell mpar (when the script uses it) that this rank failed: ``mpar.shutdown``
    at exit then skips its final barrier, which the peers would never reach."""
    abort = sys.modules.get("mpar.comm._abort")
    if abort is not None:
        abort.FAILED.set()


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
        record = _failure.error_record(
            f"killed by {name}", "", rank, pid=child_pid, mpar_signal=signum
        )
        _failure.write_json_atomically(os.path.join(rundir, f"rank{rank}.error.json"), record)


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


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent (the launcher's
    agent, or under --mpi the supervising process) dies, even by SIGKILL, so a
    killed ``mpar launch`` leaves no worker training on. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python _bootstrap.py script.py [args...]\n")
        return 2
    die_with_parent()
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
            _mark_mpar_failed()
            _report_failure(exc, script)
        _record_exit(exc.code)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if _hang_reported():  # a consequence of the hang report
            os._exit(1)  # now, without the interpreter's teardown (it may abort)
        _mark_mpar_failed()
        _report_failure(exc, script)
        _abort_mpi_if_initialized()
        return 1
    _record_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
