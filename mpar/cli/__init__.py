"""The ``mpar`` command line: ``mpar launch | plan | schedule``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``
(registers the subcommand and its options) and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

_SUBCOMMANDS = {
    "launch": "mpar.cli._launch",
    "plan": "mpar.cli._plan",
    "schedule": "mpar.cli._schedule",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpar",
        description="mpar: model-parallel and sharding runtime for PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in _SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpar`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `mpar launch` passes everything after the script name through untouched,
    # so it parses its own arguments (argparse.REMAINDER is unreliable there).
    if argv and argv[0] == "launch":
        from mpar.cli import _launch

        return _launch.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.run(args))
        sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()
    return status


def _reader_gone() -> int:
    """The reader of our output left (``mpar schedule ... | head``): stop quietly, with
    the non-zero status a Unix tool stopped by SIGPIPE has, instead of a traceback.
    Standard output goes to the null device so that the interpreter's final flush does
    not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


if __name__ == "__main__":
    sys.exit(main())
