"""Run a function on N local ranks, as torchrun would, and collect the results.

:func:`run_distributed` is the one harness every distributed test uses::

    def body(x):
        mpar.init({"pipeline_parallel_degree": 2})
        return mpar.pp_rank(), x

    results = run_distributed(body, world_size=4, args=(7,), timeout=60)

Each rank is a fresh process (forked from a server that has already imported
torch, so start-up is fast) with torchrun's variables set and gloo on
loopback; GPUs are hidden unless ``env`` says otherwise. The function's return value comes back per rank. When any rank
raises, the others are stopped and :class:`DistributedTestError` carries that
rank's traceback (and any rank's hang report: mpar's watchdog ends a job whose
ranks wait longer than ``timeout_s`` for each other); when the timeout passes,
every rank still running dumps its Python stacks (faulthandler) and the error
shows them — a hang becomes a failure that says where.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DistributedTestError", "run_distributed"]

_CONTEXT: Any = None


class DistributedTestError(AssertionError):
    """A rank failed, or the ranks did not finish in time."""


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # Imported once in the fork server so every rank starts in a fraction of a second.
        _CONTEXT.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch._dynamo",
                "torch.export",
                "mpar.runtime",
                "mpar.partition",
            ]
        )
    return _CONTEXT


def _free_port() -> int:
    from mpar.comm._process_layout import free_port

    return free_port()


def _child(
    fn: Callable[..., Any],
    args: Sequence[Any],
    rank: int,
    env: Mapping[str, str],
    results: Any,
    stderr_path: str,
) -> None:
    import faulthandler
    import sys

    stream = open(stderr_path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(stream.fileno(), 2)
    sys.stderr = stream
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    os.environ.update(env)
    try:
        # Tensors in ``args`` arrive in shared memory (torch's pickler), one storage for
        # every rank and the test process: each rank works on its own copy.
        value = fn(*copy.deepcopy(args))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    finally:
        _shutdown_quietly()
    # Plain pickle: torch's multiprocessing pickler would share tensors through
    # file descriptors that vanish when this process exits.
    results.put((rank, True, pickle.dumps(value)))


def _shutdown_quietly() -> None:
    try:
        import mpar.comm

        mpar.comm.shutdown()
    except Exception:
        pass


def _rank_env(rank: int, world_size: int, port: int, extra: Mapping[str, str]) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        # CPU ranks on gloo on any machine (several ranks cannot share one GPU under
        # NCCL); a test that wants the GPU passes env={"CUDA_VISIBLE_DEVICES": "0"}.
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.update(extra)
    return env


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def _hang_reports(logdir: Path, world_size: int, shown: int) -> str:
    """The stderr of any other rank that printed mpar's hang report (it names the culprit)."""
    found = []
    for r in range(world_size):
        text = _tail(logdir / f"rank{r}.stderr", limit=20000)
        if r != shown and "mpar: hang detected" in text:
            found.append(f"\n--- rank {r} stderr (hang report) ---\n{text}")
    return "".join(found)


def _stop(procs: list[Any], dump_stacks: bool) -> None:
    alive = [p for p in procs if p.is_alive()]
    if dump_stacks:
        for p in alive:
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
    for p in alive:
        p.kill()
    for p in procs:
        p.join(timeout=5)


def _collect(
    procs: list[Any], results: Any, world_size: int, deadline: float
) -> tuple[dict[int, Any], tuple[int, str] | None]:
    done: dict[int, Any] = {}
    while len(done) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
            dead = [i for i in dead if i not in done]
            if dead and results.empty():
                code = procs[dead[0]].exitcode
                return done, (dead[0], f"rank {dead[0]} died with exit code {code}")
            continue
        if not ok:
            return done, (rank, value)
        done[rank] = pickle.loads(value)
    return done, None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return each rank's result.

    ``fn`` and ``args`` must be picklable (a module-level function); each rank gets
    its own copy of ``args`` (a rank that changes a tensor it was given changes no
    other rank's, nor the caller's). Raises
    :class:`DistributedTestError` with the failing rank's traceback, or with
    every unfinished rank's stack dump on timeout.
    """
    if not 1 <= world_size <= 16:
        raise ValueError(f"world_size must be between 1 and 16, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    logdir = Path(tempfile.mkdtemp(prefix="mpar-test-"))
    procs = []
    for rank in range(world_size):
        rank_env = _rank_env(rank, world_size, port, env or {})
        log = str(logdir / f"rank{rank}.stderr")
        proc = ctx.Process(target=_child, args=(fn, args, rank, rank_env, results, log))
        proc.start()
        procs.append(proc)
    done, failure = _collect(procs, results, world_size, time.monotonic() + timeout)
    timed_out = failure is None and len(done) < world_size
    _stop(procs, dump_stacks=timed_out)
    if failure is not None:
        rank, text = failure
        raise DistributedTestError(
            f"rank {rank} of {world_size} failed:\n{text}\n--- rank {rank} stderr ---\n"
            f"{_tail(logdir / f'rank{rank}.stderr')}{_hang_reports(logdir, world_size, rank)}"
        )
    if timed_out:
        missing = [r for r in range(world_size) if r not in done]
        dumps = "\n".join(
            f"--- rank {r} stderr (stacks at timeout) ---\n{_tail(logdir / f'rank{r}.stderr')}"
            for r in missing
        )
        raise DistributedTestError(
            f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
            f"(a hang?)\n{dumps}"
        )
    return [done[r] for r in range(world_size)]
