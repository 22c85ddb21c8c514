"""The README's two set-up commands, and CI running the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "mpar launch --nproc-per-node 4" in commands[0]
    assert "pytest" in commands[1] and "mypy" in commands[1] and "ruff" in commands[1]


def test_ci_runs_readme_command_two_verbatim():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def test_main_job_files_exist():
    command = _readme_commands()[0]
    for path in re.findall(r"(examples/\S+)", command):
        assert (ROOT / path).is_file(), path
