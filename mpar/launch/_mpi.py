"""Run a job with mpiexec/mpirun (``mpar launch --mpi``).

mpiexec starts and places the processes; ``mpar.init()`` reads the MPI layout
through mpi4py. The launcher adds what mpiexec lacks:

* it finds mpiexec (next to ``sys.executable`` first: the ``mpich`` wheel puts it
  there; then ``PATH``) and speaks its dialect (MPICH/Hydra, Open MPI);
* it exports the workers' variables (``MPAR_CONFIG``, ``OMP_NUM_THREADS``) to
  every node (Hydra passes the whole environment; Open MPI needs ``-x NAME``);
* it stops the job when a rank fails. Hydra tears the job down when a rank dies
  by a signal or calls ``MPI_Abort``, but waits for the other ranks when one
  merely exits non-zero; so the launcher relays mpiexec's output, and when a
  rank's bootstrap reports a failure it terminates mpiexec, which stops every
  rank. Finally it names the failing rank and repeats its traceback.
* each rank runs under a small supervisor (``_bootstrap.py`` again), which sees
  the rank's exact exit status, so a rank killed by a signal (kill -9, the OOM
  killer) is named too; mpiexec cannot tell which rank died first.

Commands are argument lists; nothing is ever run through a shell.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Literal

from mpar._failure import FAILURE_MARKER
from mpar.launch._child import BOOTSTRAP_PATH, RUNDIR_ENV, SUPERVISE_ENV
from mpar.launch._env import TORCHRUN_VARIABLES
from mpar.launch._options import LaunchError, LaunchOptions
from mpar.launch._report import (
    RankFailure,
    choose_root,
    exit_status,
    failure_from_record,
    format_report,
    read_error_file,
)

__all__ = ["Flavor", "build_mpi_command", "find_mpiexec", "mpi_flavor", "run_mpi"]

Flavor = Literal["hydra", "openmpi", "other"]

_ABORT_GRACE_S = 2.0  # time for a failing rank's MPI_Abort before the launcher steps in
_TERMINATE_GRACE_S = 10.0  # SIGTERM to mpiexec -> SIGKILL
_MARKER = re.compile(re.escape(FAILURE_MARKER) + r" (\d+|\?) \(pid (\d+) on (\S+)\) failed")
_OPENMPI_RANK = re.compile(r"rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)")


def find_mpiexec(explicit: str | None = None) -> str:
    """The mpiexec to use: ``explicit``, then next to python, then on PATH."""
    if explicit is not None:
        found = shutil.which(explicit)
        if found is None:
            raise LaunchError(f"--mpiexec {explicit!r} is not an executable file.")
        return found
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec", "mpirun"):
        candidate = os.path.join(here, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise LaunchError(
        "--mpi needs mpiexec or mpirun, and none was found next to "
        f"{sys.executable} or on PATH. Install one (pip install mpich mpi4py) or "
        "give its path with --mpiexec."
    )


def mpi_flavor(mpiexec: str) -> Flavor:
    """Which MPI an mpiexec belongs to, from its ``--version`` text."""
    try:
        done = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "other"
    text = done.stdout + done.stderr
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text:
        return "openmpi"
    return "other"


def build_mpi_command(
    mpiexec: str,
    flavor: Flavor,
    *,
    nprocs: int,
    per_node: int,
    hostfile: str | None,
    export: Sequence[str],
    program: Sequence[str],
) -> list[str]:
    """The mpiexec argument list starting ``program`` on ``nprocs`` ranks."""
    cmd = [mpiexec, "-n", str(nprocs)]
    if flavor == "hydra":
        if hostfile is not None:
            cmd += ["-f", hostfile, "-ppn", str(per_node)]
        cmd += ["-genvall"]
    elif flavor == "openmpi":
        if hostfile is not None:
            cmd += ["--hostfile", hostfile, "--map-by", f"ppr:{per_node}:node"]
        else:
            cmd += ["--oversubscribe"]
        for name in export:
            cmd += ["-x", name]
    elif hostfile is not None:
        cmd += ["-hostfile", hostfile]
    return cmd + list(program)


@dataclass
class _Watch:
    """What the stderr reader learned while the job ran."""

    reported: list[tuple[int | None, int, str]] = field(default_factory=list)
    """(rank, pid, host) of each bootstrap failure line, in order."""
    first_report_at: float | None = None
    openmpi_failure: RankFailure | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def scan(self, line: str) -> None:
        with self.lock:
            if (m := _MARKER.search(line)) is not None:
                rank = None if m.group(1) == "?" else int(m.group(1))
                self.reported.append((rank, int(m.group(2)), m.group(3)))
                if self.first_report_at is None:
                    self.first_report_at = time.monotonic()
            elif (m := _OPENMPI_RANK.search(line)) is not None and self.openmpi_failure is None:
                self.openmpi_failure = RankFailure(
                    rank=int(m.group(1)),
                    pid=int(m.group(2)),
                    host=m.group(3),
                    exitcode=-int(m.group(4)),
                )


def _pump(stream: IO[bytes], out: IO[bytes], watch: _Watch) -> None:
    """Copy one of mpiexec's streams to ours, line by line, and scan it."""
    for raw in iter(stream.readline, b""):
        out.write(raw)
        out.flush()
        watch.scan(raw.decode("utf-8", errors="replace"))


@contextlib.contextmanager
def _forward_signals(proc: subprocess.Popen[bytes]) -> Iterator[list[int]]:
    """SIGINT/SIGTERM/SIGHUP to the launcher go to mpiexec, which stops the ranks."""
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    names = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.signal(s, forward) for s in names}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(proc: subprocess.Popen[bytes], watch: _Watch) -> None:
    """Wait for mpiexec; stop it once a rank reported a failure and it did not stop."""
    terminated_at: float | None = None
    while True:
        try:
            proc.wait(timeout=0.1)
            return
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        with watch.lock:
            reported_at = watch.first_report_at
        if terminated_at is None and reported_at is not None and now - reported_at > _ABORT_GRACE_S:
            proc.terminate()
            terminated_at = now
        elif terminated_at is not None and now - terminated_at > _TERMINATE_GRACE_S:
            proc.kill()


def _collect_failures(watch: _Watch, rundir: str) -> list[RankFailure]:
    failures: list[RankFailure] = []
    for rank, pid, host in watch.reported:
        record = read_error_file(os.path.join(rundir, f"rank{rank}.error.json"))
        if record is not None:
            failures.append(failure_from_record(record, rank=rank, pid=pid, exitcode=None))
        else:
            failures.append(RankFailure(rank=rank, pid=pid, host=host))
    reported = {f.rank for f in failures}
    if watch.openmpi_failure is not None and watch.openmpi_failure.rank not in reported:
        failures.append(watch.openmpi_failure)
    return failures


def run_mpi(options: LaunchOptions, extra_env: Mapping[str, str]) -> int:
    """Run the job under mpiexec; the exit status of the job."""
    mpiexec = find_mpiexec(options.mpiexec)
    flavor = mpi_flavor(mpiexec)
    rundir = tempfile.mkdtemp(prefix="mpar-launch-mpi-")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(extra_env)
    env[RUNDIR_ENV] = rundir
    env[SUPERVISE_ENV] = "1"
    program = [sys.executable, "-u", BOOTSTRAP_PATH, options.script, *options.script_args]
    cmd = build_mpi_command(
        mpiexec,
        flavor,
        nprocs=options.world_size,
        per_node=options.nproc_per_node,
        hostfile=options.hostfile,
        export=sorted({*extra_env, RUNDIR_ENV, SUPERVISE_ENV}),
        program=program,
    )
    watch = _Watch()
    try:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        readers = [
            threading.Thread(target=_pump, args=(pipe, out, watch), daemon=True)
            for pipe, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))
        ]
        for reader in readers:
            reader.start()
        with _forward_signals(proc) as received:
            _wait(proc, watch)
        for reader in readers:
            reader.join(timeout=5)
        if proc.returncode == 0 and not watch.reported:
            return 0
        failures = _collect_failures(watch, rundir)
        if not failures:
            if received:
                sys.stderr.write(f"mpar launch: stopped the job on signal {received[0]}\n")
                return 128 + received[0]
            sys.stderr.write(f"mpar launch: mpiexec exited with code {proc.returncode}\n")
            return proc.returncode if proc.returncode > 0 else 1
        sys.stderr.write(format_report(failures, launcher="mpar launch"))
        return exit_status(choose_root(failures))
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
