"""Command-line options of ``mpar launch`` and their validation (no processes here).

Everything after the script path belongs to the script, so the command line is
split by hand at the first word that is not a launcher option (or after
``--``); argparse only ever sees the launcher's own part.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpar.errors import MparError

__all__ = ["LaunchError", "LaunchOptions", "build_parser", "parse_options"]

USAGE = "%(prog)s [options] script.py [script args...]"


class LaunchError(MparError, ValueError):
    """The launch command line cannot work; the message says how to fix it."""


@dataclass(frozen=True)
class LaunchOptions:
    """What to start, where, and how (all paths absolute)."""

    script: str
    """The user's Python script; it runs as ``__main__`` in every process."""
    script_args: tuple[str, ...] = ()
    """Passed to the script untouched."""
    nproc_per_node: int = 1
    """Processes started on this node."""
    nnodes: int = 1
    """Launcher invocations (nodes) taking part."""
    node_rank: int = 0
    """This node's index in ``range(nnodes)``; node 0 hosts the rendezvous."""
    master_addr: str | None = None
    """Address of node 0; None: a single-node job on 127.0.0.1."""
    master_port: int | None = None
    """Rendezvous port on node 0; None: a free port (single node) or 29500."""
    config: str | None = None
    """mpar config file handed to ``mpar.init()`` through ``MPAR_CONFIG``."""
    mpi: bool = False
    """Start the processes with mpiexec/mpirun instead of torch's elastic agent."""
    mpiexec: str | None = None
    """Explicit mpiexec/mpirun executable for ``--mpi``."""
    hostfile: str | None = None
    """Hostfile for ``--mpi`` across several nodes."""
    max_restarts: int = 0
    """Restarts of the whole worker group after a failure (elastic agent only)."""
    rdzv_timeout: int = 300
    """Seconds the nodes wait for each other at the rendezvous."""
    run_id: str = "mpar"
    """Job id shared by all nodes of one job."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {value}")
    return value


# (flags, argparse keyword arguments) of every launcher option, in --help order.
_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--nproc-per-node", "--nproc_per_node"),
     {"type": _positive_int, "default": 1, "metavar": "N",
      "help": "processes on this node (default 1)"}),
    (("--nnodes",),
     {"type": _positive_int, "default": 1, "metavar": "N",
      "help": "number of nodes, one launcher on each (default 1)"}),
    (("--node-rank", "--node_rank"),
     {"type": _non_negative_int, "default": 0, "metavar": "R",
      "help": "this node's index, 0..nnodes-1 (default 0)"}),
    (("--master-addr", "--master_addr"),
     {"default": None, "metavar": "ADDR",
      "help": "address of node 0 (default: 127.0.0.1, single node only)"}),
    (("--master-port", "--master_port"),
     {"type": _port, "default": None, "metavar": "PORT",
      "help": "rendezvous port on node 0 (default: a free port on one node, else 29500)"}),
    (("--config",),
     {"default": None, "metavar": "FILE",
      "help": "mpar config (JSON/YAML) for mpar.init(), passed as MPAR_CONFIG"}),
    (("--mpi",),
     {"action": "store_true",
      "help": "start the processes with mpiexec/mpirun (mpar.init() reads the MPI layout)"}),
    (("--mpiexec",),
     {"default": None, "metavar": "PATH",
      "help": "mpiexec/mpirun to use with --mpi (default: next to python, then PATH)"}),
    (("--hostfile",),
     {"default": None, "metavar": "FILE", "help": "MPI hostfile for --mpi across nodes"}),
    (("--max-restarts", "--max_restarts"),
     {"type": _non_negative_int, "default": 0, "metavar": "N",
      "help": "restart all workers up to N times after a failure (default 0)"}),
    (("--rdzv-timeout",),
     {"type": _positive_int, "default": 300, "metavar": "SECONDS",
      "help": "how long nodes wait for each other at start-up (default 300)"}),
    (("--run-id",),
     {"default": "mpar", "metavar": "ID",
      "help": "job id, the same on every node (default 'mpar')"}),
)  # fmt: skip
_VALUE_FLAGS = frozenset(
    flag for flags, kwargs in _OPTIONS if "action" not in kwargs for flag in flags
)


def build_parser(prog: str = "mpar launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=USAGE,
        allow_abbrev=False,
        description=(
            "Start script.py on several processes with the variables mpar.init() and "
            "torch.distributed's env:// read (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...). "
            "Uses torch's elastic agent, or mpiexec with --mpi. Arguments after the script "
            "are passed to it untouched."
        ),
        epilog="See docs/launching.md for torchrun, mpirun, srun and Kubernetes recipes.",
    )
    for flags, kwargs in _OPTIONS:
        parser.add_argument(*flags, **kwargs)
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], str | None, list[str]]:
    """Split ``argv`` into (launcher options, script, script arguments)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            rest = list(argv[i + 1 :])
            return list(argv[:i]), (rest[0] if rest else None), rest[1:]
        if word.startswith("-") and word != "-":
            takes_value = "=" not in word and word in _VALUE_FLAGS
            i += 2 if takes_value else 1
            continue
        return list(argv[:i]), word, list(argv[i + 1 :])
    return list(argv), None, []


def parse_options(argv: Sequence[str], prog: str = "mpar launch") -> LaunchOptions:
    """Parse and check a launch command line; raises ``LaunchError`` (or exits for --help)."""
    parser = build_parser(prog)
    own, script, script_args = split_argv(argv)
    ns = parser.parse_args(own)
    if script is None:
        raise LaunchError(
            f"no script given. Usage: {prog} [options] script.py [args...], "
            f"e.g. {prog} --nproc-per-node 2 examples/train_cnn.py"
        )
    options = LaunchOptions(
        script=_existing_script(script),
        script_args=tuple(script_args),
        nproc_per_node=ns.nproc_per_node,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        config=_existing_file(ns.config, "--config") if ns.config else None,
        mpi=ns.mpi,
        mpiexec=ns.mpiexec,
        hostfile=_existing_file(ns.hostfile, "--hostfile") if ns.hostfile else None,
        max_restarts=ns.max_restarts,
        rdzv_timeout=ns.rdzv_timeout,
        run_id=ns.run_id,
    )
    _check_layout(options)
    return options


def _existing_script(path: str) -> str:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        where = "is a folder" if os.path.isdir(full) else "does not exist"
        raise LaunchError(
            f"script {path!r} not found ({full} {where}). Give the path of a Python file, "
            "relative to the current folder or absolute."
        )
    return full


def _existing_file(path: str, flag: str) -> str:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise LaunchError(f"{flag} {path!r} not found ({full} is not a file).")
    return full


def _check_layout(options: LaunchOptions) -> None:
    if options.node_rank >= options.nnodes:
        raise LaunchError(
            f"--node-rank {options.node_rank} is out of range for --nnodes {options.nnodes}: "
            f"use 0..{options.nnodes - 1}."
        )
    if options.mpi:
        if options.max_restarts:
            raise LaunchError(
                "--max-restarts needs the elastic agent; it cannot be used with --mpi."
            )
        if options.nnodes > 1 and options.hostfile is None:
            raise LaunchError(
                f"--mpi with --nnodes {options.nnodes} needs --hostfile listing the nodes "
                "(see launch/hostfile.example)."
            )
        return
    if options.hostfile is not None:
        raise LaunchError("--hostfile is for --mpi; without it, start one launcher per node.")
    if options.nnodes > 1 and options.master_addr is None:
        raise LaunchError(
            f"--nnodes {options.nnodes} needs --master-addr, the address of node 0 that every "
            "node can reach (and the same --master-port on every node)."
        )
