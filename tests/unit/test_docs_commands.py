"""Command lines the README and docs/ show: every flag they pass exists.

A reader copies ``mpar launch ... examples/train_cnn.py --steps 20`` or
``mpar plan --hf-config ... --seq-len 4096``; a flag the parser does not know
fails at once on the reader's machine, so each documented flag is checked
against the parser (``mpar launch | plan | schedule``) or the example script's
own ``add_argument`` calls. Pure text and argparse, no processes.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mpar.cli import build_parser
from mpar.launch._options import build_parser as build_launch_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _command_lines() -> list[tuple[str, str]]:
    """(page, line) for every line naming an mpar command or an example, backslash
    continuations joined, cut at the end of an inline code span or a comment."""
    found = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            for piece in re.split(r"`", line):
                piece = piece.split(" #", 1)[0]
                if re.search(r"\bmpar (launch|plan|schedule)\b|examples/\w+\.py", piece):
                    found.append((page.name, piece.strip()))
    return found


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _subcommand_options() -> dict[str, set[str]]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {name: _options(sub) for name, sub in subparsers.choices.items()}
    options["launch"] = _options(build_launch_parser())
    return options


def _script_flags(script: str) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", (ROOT / script).read_text()))


def test_documented_command_lines_were_found() -> None:
    lines = _command_lines()
    assert len(lines) > 30, lines  # the extraction itself works
    assert any("examples/train_cnn.py" in line for _, line in lines)


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_every_documented_flag_exists(page: str) -> None:
    known = _subcommand_options()
    unknown = []
    for where, line in _command_lines():
        if where != page:
            continue
        script = re.search(r"examples/\w+\.py", line)
        before = line[: script.start()] if script else line
        after = line[script.end() :] if script else ""
        command = re.search(r"\bmpar (launch|plan|schedule)\b", before)
        if command:
            for flag in FLAG.findall(before[command.end() :]):
                if flag not in known[command.group(1)]:
                    unknown.append(f"mpar {command.group(1)} {flag}: {line}")
        if script:
            for flag in FLAG.findall(after):
                if flag not in _script_flags(script.group(0)) | {"--help"}:
                    unknown.append(f"{script.group(0)} {flag}: {line}")
    assert not unknown, "\n".join(unknown)
