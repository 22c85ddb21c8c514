"""``mpar launch``: start a script on several processes, on one node or many.

    mpar launch --nproc-per-node 4 train.py --lr 0.1
    python -m mpar.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
    mpar launch --mpi --nproc-per-node 4 --config cfg.json train.py

Without ``--mpi`` the processes are started and watched by torch's elastic agent
(as with ``torchrun``); with ``--mpi`` by mpiexec. Each process gets the
variables ``mpar.init()`` reads, ``MPAR_CONFIG`` for ``--config``, and
``OMP_NUM_THREADS`` = CPUs / local processes unless already set. When a rank
fails, the others are stopped and the launcher exits non-zero, naming the rank
and printing its traceback. See docs/launching.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from mpar.launch._options import LaunchError, LaunchOptions, parse_options

__all__ = ["LaunchError", "LaunchOptions", "launch", "main", "parse_options"]


def launch(options: LaunchOptions) -> int:
    """Run the job described by ``options``; returns its exit status."""
    from mpar._device import host_cores
    from mpar.launch._checks import check_pipeline_degree
    from mpar.launch._env import worker_environment

    check_pipeline_degree(options, os.environ)
    extra_env = worker_environment(options, os.environ, cpus=host_cores())
    if options.mpi:
        from mpar.launch._mpi import run_mpi

        return run_mpi(options, extra_env)
    from mpar.launch._elastic import run_elastic

    return run_elastic(options, extra_env)


def main(argv: Sequence[str] | None = None, *, prog: str = "mpar launch") -> int:
    """Command-line entry: parse ``argv``, launch, and return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return launch(parse_options(argv, prog=prog))
    except LaunchError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    except SystemExit as exc:  # argparse: --help, or a malformed option
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
