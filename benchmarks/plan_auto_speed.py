"""How long ``mpar plan --auto`` takes on the jobs issue 44 names, end to end (the
meta profile included), each in a fresh process: wall and CPU seconds.

    python benchmarks/plan_auto_speed.py            # 7B at 16 ranks, 70B at 64 (twice)
    python benchmarks/plan_auto_speed.py --only 7b

Targets (issue 44): Llama-2-7B shape at 16 ranks < 15 s, Llama-3-70B at 64 ranks
< 60 s. CPU seconds are the figure to compare on a shared machine: wall time
grows with the load.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"

JOBS = {
    "7b": ["--hf-config", str(CONFIGS / "llama2-7b"), "--seq-len", "4096", "--world-size", "16",
           "--device-memory", "80GiB", "--global-batch", "64"],
    "70b-cuda": ["--hf-config", str(CONFIGS / "llama3-70b"), "--seq-len", "8192",
                 "--world-size", "64", "--device-memory", "80GiB", "--global-batch", "512",
                 "--device", "cuda", "--tp-bandwidth", "150GB", "--block-checkpointing"],
    "70b-h100": ["--hf-config", str(CONFIGS / "llama3-70b"), "--seq-len", "8192",
                 "--world-size", "64", "--global-batch", "512", "--cluster", "h100",
                 "--block-checkpointing"],
}  # fmt: skip


def _time(argv: list[str]) -> dict[str, object]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mpar", "plan", "--auto", *argv, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row: dict[str, object] = {
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "rc": done.returncode,
    }
    if done.returncode == 0:
        data = json.loads(done.stdout)
        row["best"] = data["candidates"][0]
        row["laid_out"], row["fit"] = data["evaluated"], data["fitting"]
    else:
        row["error"] = done.stderr.strip().splitlines()[-1:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(JOBS), default=list(JOBS))
    args = parser.parse_args()
    for name in args.only:
        row = _time(JOBS[name])
        best = row.pop("best", None)
        print(name, json.dumps(row))
        if isinstance(best, dict):
            keys = ("pipeline_parallel_degree", "data_parallel_degree", "tensor_parallel_degree",
                    "zero_stage", "activation_checkpointing", "step_time_s", "mfu")  # fmt: skip
            print("   best:", {k: best.get(k) for k in keys})


if __name__ == "__main__":
    main()
