"""Command lines the README and docs/ show: every flag they pass exists.

A reader copies ``mpar launch ... examples/train_cnn.py --steps 20`` or
``mpar plan --hf-config ... --seq-len 4096``; a flag the parser does not know
fails at once on the reader's machine, so each documented flag is checked
against the parser (``mpar launch | plan | schedule``) or the example's or
benchmark's own ``add_argument`` calls (pure text and argparse). The names the
``python`` snippets use (``mpar.a.b``, ``from mpar.x import y``) are resolved too,
in one fresh interpreter.
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
                if re.search(
                    r"\bmpar (launch|plan|schedule)\b|(examples|benchmarks)/\w+\.py", piece
                ):
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
        script = re.search(r"(examples|benchmarks)/\w+\.py", line)
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


def _python_snippets() -> list[tuple[str, str]]:
    """(page, code) of every ```python block, comments removed."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            code = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
            found.append((page.name, code))
    return found


_RESOLVE = """
import importlib, json, sys
import mpar
missing = []
snippets = json.loads(sys.stdin.read())
for page, dotted_names, imported in snippets:  # `import mpar` alone: a fresh interpreter
    for dotted in dotted_names:
        if any(dotted == m or dotted.startswith(m + ".") for m in imported):
            continue  # the snippet imports that module itself
        value = mpar
        for name in dotted.split(".")[1:]:
            if not hasattr(value, name):
                missing.append(f"{page}: {dotted} (no {name!r} after import mpar)")
                break
            value = getattr(value, name)
for page, _, imported in snippets:
    for module in imported:
        importlib.import_module(module)
print(json.dumps(missing))
"""


def test_mpar_names_in_python_snippets_resolve() -> None:
    """A snippet's ``mpar.a.b`` works after ``import mpar`` (and the imports the snippet
    makes), and its ``from mpar.x import y`` imports; checked in a fresh interpreter, where
    no other test has imported anything (before: docs/tensor_parallel.md used
    mpar.testing.models, which ``import mpar`` does not load: AttributeError)."""
    import importlib
    import json
    import subprocess
    import sys

    snippets = []
    for page, code in _python_snippets():
        imports = re.findall(r"^\s*import (mpar\.[\w.]+)", code, re.M)
        froms = re.findall(r"^\s*from (mpar[\w.]*) import ([\w, ]+)", code, re.M)
        body = re.sub(r"^\s*(from|import) .*$", "", code, flags=re.M)
        dotted = re.findall(r"(?<![\w.])mpar(?:\.\w+)+", body)
        snippets.append((page, dotted, imports + [m for m, _ in froms]))
        for module, names in froms:
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(importlib.import_module(module), name), f"{page}: {module}.{name}"
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE],
        input=json.dumps(snippets),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    missing = json.loads(done.stdout.splitlines()[-1])
    assert not missing, "\n".join(missing)
