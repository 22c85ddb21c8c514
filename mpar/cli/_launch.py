"""``mpar launch``: the subcommand's glue; the launcher itself is ``mpar.launch``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_parser", "main", "run"]

HELP = "start a script on N processes (torch elastic agent, or mpiexec with --mpi)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``launch``; its options are parsed by ``mpar.launch`` (see ``main``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "launch",
        help=HELP,
        description=f"{HELP}. Run 'mpar launch --help' for the options.",
        add_help=False,
        prefix_chars="\0",  # every word is the launcher's to parse, "--..." included
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    return main(args.argv)


def main(argv: Sequence[str]) -> int:
    """``mpar launch ARGV...``: everything after the script goes to the script untouched."""
    from mpar.launch import main as launch_main

    return launch_main(list(argv), prog="mpar launch")
