"""What the side-by-side benchmarks share: starting one job per case, and its peak memory.

``benchmarks/pipeline.py`` and ``benchmarks/zero.py`` start every case as its own
job (``mpar launch`` for mpar, ``torchrun`` for the peers), with the same thread
and allocator settings, and read back what rank 0 wrote to a result file.

Peak memory (DESIGN.md, performance method): each rank samples its own RSS from
``/proc/self/statm`` every ``MPAR_BENCH_RSS_INTERVAL_S`` seconds (default 0.002) on a
thread (``mpar.testing.rss.RssPeak``) while the
timed steps run; jobs run with ``MALLOC_MMAP_THRESHOLD_=65536`` so large tensors
are mmapped and leave RSS as soon as they are freed. ``peak_above_baseline`` is
the peak over the timed steps minus the RSS right before them (model, optimizer
state and caches of the warm-up steps are in the baseline): what one step
gathers, reduces and saves for backward beyond the state kept between steps.
On CUDA the same numbers come from ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

from mpar.testing.rss import RssPeak

HERE = Path(__file__).resolve().parent

__all__ = [
    "JsonCase",
    "job_env",
    "launch_job",
    "launcher",
    "measured_steps",
    "missing_module",
    "round_ratios",
    "run_rounds",
]


class JsonCase:
    """A benchmark case (a dataclass) that travels to its job's workers as JSON: its
    ``model`` field is a dataclass of the type ``MODEL`` names, and its lists come back
    as tuples."""

    MODEL: ClassVar[type]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Self:
        raw = json.loads(text)
        raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        raw["model"] = cls.MODEL(**raw["model"])
        return cls(**raw)


def job_env(threads: int, mmap_threshold: bool = True) -> dict[str, str]:
    """The environment of every benchmark job.

    ``mmap_threshold``: ``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors leave RSS at
    once and sampled peaks are the tensors' (memory benchmarks). It costs speed: every
    allocation above 64 KiB is a fresh mapping whose pages fault in when first written
    (the pipeline benchmark's model ran about 1.5x slower in every framework), so
    throughput benchmarks run without it.
    """
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")])),
    )
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    return env


def launcher(framework: str, nproc: int, python: str | None = None) -> list[str]:
    """``mpar launch`` for mpar, ``torchrun --standalone`` for the peers (run by
    ``python``: a peer installed in an environment of its own; default this one)."""
    if framework == "mpar":
        return [sys.executable, "-m", "mpar", "launch", "--nproc-per-node", str(nproc)]
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ]


def _error(proc: subprocess.CompletedProcess[str]) -> str:
    """The failing job's error lines (the workers' own, not the launcher's summary)."""
    text = (proc.stderr or "") + (proc.stdout or "")
    pattern = re.compile(r"Error|error:|terminate called|exitcode|Signal \d+")
    keep = [
        line.strip()
        for line in text.splitlines()
        if pattern.search(line) and "Warning" not in line and "ChildFailedError" not in line
    ]
    return "\n".join(list(dict.fromkeys(keep))[:6]) or text[-2000:]


def launch_job(
    framework: str,
    nproc: int,
    script: Path,
    worker_args: list[str],
    threads: int,
    timeout: float,
    mmap_threshold: bool = True,
    python: str | None = None,
) -> dict[str, Any]:
    """Run ``script`` as one job; its rank 0 writes the result to ``--result FILE``
    (``mmap_threshold``: see :func:`job_env`; ``python``: see :func:`launcher`)."""
    with tempfile.TemporaryDirectory(prefix="mpar-bench-") as tmp:
        out = Path(tmp) / "result.json"
        start_cmd = launcher(framework, nproc, python)
        cmd = [*start_cmd, str(script), *worker_args, "--result", str(out)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                env=job_env(threads, mmap_threshold),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            return {"status": "failed", "reason": f"timed out after {timeout:.0f} s: {exc.cmd}"}
        if proc.returncode != 0 or not out.exists():
            return {"status": "failed", "reason": f"exit {proc.returncode}\n{_error(proc)}"}
        wall = time.perf_counter() - start
        return {"status": "ok", "job_wall_s": wall, **json.loads(out.read_text())}


def missing_module(module: str | None) -> str | None:
    """Why a peer cannot run here (its module is not installed), or None."""
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{module} is not installed"


def measured_steps(
    step: Callable[[], None], barrier: Callable[[], None], warmup: int, steps: int
) -> dict[str, Any]:
    """``warmup`` untimed steps, then ``steps`` timed ones between two barriers, with
    this rank's RSS baseline (before them) and peak (during them)."""
    import statistics

    for _ in range(warmup):
        step()
    barrier()
    per_step = []
    interval = float(os.environ.get("MPAR_BENCH_RSS_INTERVAL_S", "0.002"))
    with RssPeak(interval) as rss:
        baseline = rss.reset()
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            step()
            per_step.append(time.perf_counter() - t)
        barrier()
        elapsed = time.perf_counter() - start
    mine = {
        "rss_baseline_bytes": baseline,
        "rss_peak_bytes": rss.peak,
        "peak_above_baseline_bytes": rss.peak - baseline,
    }
    return {
        "elapsed_s": elapsed,
        "step_s": elapsed / steps,
        "per_step_s": per_step,
        "median_step_s": statistics.median(per_step),
        **mine,
        "peak_per_rank": _every_rank(mine),
    }


def _every_rank(value: dict[str, int]) -> list[dict[str, int]]:
    """``value`` of every rank, in rank order (just this one without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_rounds(
    runs: dict[str, list[dict[str, Any]]],
    rounds: int,
    run: Callable[[str], dict[str, Any]],
    show: Callable[[str, dict[str, Any]], str],
    skip: dict[str, str | None],
    stop: Callable[[str, int, dict[str, Any]], str | None],
    prefix: str = "",
    after_round: Callable[[], object] | None = None,
) -> None:
    """``rounds`` rounds of one job per name of ``runs``, the order reversed every other
    round (so neither side always runs first on a machine whose load drifts), appended
    to ``runs[name]`` as they come.

    ``run(name)`` runs one job; a name whose ``skip`` reason is set is recorded as
    skipped instead; ``stop(name, round, got)`` gives the reason to skip it in later
    rounds (a peer that failed), or None. Each job prints ``[<prefix>r/rounds] name:
    show(name, got)``; ``after_round`` runs after each round (writing what is done)."""
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            if skip.get(name) is not None:
                runs[name].append({"status": "skipped", "reason": skip[name]})
                continue
            got = run(name)
            runs[name].append(got)
            print(f"[{prefix}{r + 1}/{rounds}] {name}: {show(name, got)}", flush=True)
            skip[name] = stop(name, r, got) or skip.get(name)
        if after_round is not None:
            after_round()


def round_ratios(ours: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]]) -> list[float]:
    """Per round where both ran: the other's median step time over ours (> 1: ours is
    faster)."""
    return [
        b["median_step_s"] / a["median_step_s"]
        for a, b in zip(ours, other, strict=False)
        if a["status"] == "ok" and b["status"] == "ok"
    ]
