"""The layer order of mpar's packages, checked over every import (``ast``, no imports run).

Data flows one way (DESIGN.md): config → topology → profile → partition → shard →
runtime → step results; the process groups (comm) sit under sharding and the
runtime; checkpoint, the public API and the launcher are shells; cli is the top.
A module may import modules of its own layer or of the layers before it, never
one after it. Imports inside functions and under ``TYPE_CHECKING`` count too.

Notes on the order:

- ``mpar.topology`` (the rank grid and the placement letters) sits under ``config``:
  it is pure geometry, and ``config`` checks ``placement_strategy`` with it.
- ``mpar._attention_blocks`` (block attention with its log-sum-exp) and
  ``mpar._cp_context`` (which tokens a context-parallel rank holds, and their masks)
  are leaves: pure torch, read by the CP operators in ``comm`` and by
  ``context_parallel`` above them.
- ``mpar._tp_styles`` (tensor-parallel style names) is a leaf: ``config`` checks a
  ``tp_plan`` with it and ``partition`` reads the parsed styles, below the
  ``tensor_parallel`` package that applies them.
- ``mpar.profile._units`` (where a model can be cut) is part of ``profile``: the
  profiler measures per unit; ``partition`` (cost model, solver, planner) reads
  profiles and sits above it.
- ``mpar.launch`` only imports the leaves: the child entry of ``mpar launch``
  runs before torch is imported. It sits just under cli, and nothing under it
  may import it (comm records failures through the ``mpar._failure`` leaf).

No layer has exceptions: a lazy import inside a function is checked like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

import mpar

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "leaves",
        (
            "mpar.errors",
            "mpar._size",
            "mpar._failure",
            "mpar._tree",
            "mpar._compat",
            "mpar._swap",
            "mpar._tp_styles",
            "mpar._attention_blocks",
            "mpar._cp_context",
            "mpar._targets",
        ),
    ),
    ("schedule", ("mpar.schedule",)),
    ("topology", ("mpar.topology",)),
    ("config", ("mpar.config",)),
    ("device", ("mpar._device", "mpar._streams")),
    ("profile", ("mpar.profile",)),
    ("partition", ("mpar.partition",)),
    ("comm", ("mpar.comm",)),
    ("tensor_parallel", ("mpar.tensor_parallel", "mpar.expert_parallel")),
    ("context_parallel", ("mpar.context_parallel",)),
    ("shard", ("mpar.shard",)),
    ("meta", ("mpar.meta",)),
    ("runtime", ("mpar.runtime",)),
    ("checkpoint", ("mpar.checkpoint",)),
    ("api", ("mpar", "mpar._ranks", "mpar._data", "mpar.testing")),
    ("launch", ("mpar.launch",)),
    ("cli", ("mpar.cli", "mpar.__main__")),
]
"""Bottom first; each entry names a layer and the module prefixes in it (``"mpar"``
names the package's ``__init__`` only)."""

PURE = ("schedule", "config", "topology", "profile", "partition")
"""Packages that must stay testable without processes: never above ``device``'s peers
(``comm``, ``shard``, ``runtime``, ``checkpoint``, ``launch``)."""


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of ``module``: its longest matching prefix decides."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = prefix != "mpar" and module.startswith(prefix + ".")
            if (module == prefix or inside) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise ValueError(f"module {module!r} is in no layer: add it to LAYERS in {__file__}")
    return best


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The mpar modules ``source`` imports (``from mpar import x`` names ``mpar.x`` when
    that is a module of ``modules``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Call) and _call_name(node) in ("import_module", "__import__"):
            found.update(
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            )
    return {m for m in found if m == "mpar" or m.startswith("mpar.")}


def _call_name(node: ast.Call) -> str | None:
    """The called function's name: ``f`` for ``f(...)`` and ``m.f(...)``."""
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def violations(sources: Mapping[str, str]) -> list[str]:
    """Every import of ``sources`` (module name → source text) that goes up the layers."""
    problems = []
    names = set(sources)
    for module, source in sorted(sources.items()):
        mine = layer_of(module)
        for target in sorted(imported_modules(source, names)):
            theirs = layer_of(target)
            if theirs > mine:
                problems.append(
                    f"{module} (layer {LAYERS[mine][0]}) imports {target} "
                    f"(layer {LAYERS[theirs][0]}, above it)"
                )
    return problems


def _package_sources() -> dict[str, str]:
    root = Path(mpar.__file__).parent
    sources = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text()
    return sources


def test_no_module_imports_a_layer_above_its_own():
    assert violations(_package_sources()) == []


def test_every_module_has_a_layer():
    for module in _package_sources():
        layer_of(module)  # raises for a module left out of LAYERS
    with pytest.raises(ValueError, match="'mpar._new' is in no layer"):
        layer_of("mpar._new")


def test_the_pure_packages_sit_below_the_process_layers():
    names = [name for name, _ in LAYERS]
    lowest_process_layer = min(names.index(n) for n in ("comm", "shard", "runtime", "launch"))
    assert all(names.index(p) < lowest_process_layer for p in PURE)
    assert names[-1] == "cli"


def test_the_checker_finds_a_planted_violation():
    sources = {
        "mpar.schedule._fake": "import torch\nfrom mpar.errors import ScheduleError\n",
        "mpar.config._fake": "def f():\n    from mpar.runtime import step\n",
        "mpar.comm._fake": "from mpar import launch\n",
        "mpar.partition._solver_fake": "from mpar.profile._units import find_units\n",
        "mpar.launch": "",
        "mpar.runtime._x": "from mpar.cli import main\n",
        "mpar.profile._lazy": "def f():\n    importlib.import_module('mpar.shard')\n",
    }
    found = violations(sources)
    assert found == [
        "mpar.comm._fake (layer comm) imports mpar.launch (layer launch, above it)",
        "mpar.config._fake (layer config) imports mpar.runtime (layer runtime, above it)",
        "mpar.profile._lazy (layer profile) imports mpar.shard (layer shard, above it)",
        "mpar.runtime._x (layer runtime) imports mpar.cli (layer cli, above it)",
    ]


def test_the_checker_sees_imports_under_type_checking():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mpar.shard\n"
    assert violations({"mpar.profile._fake": source}) == [
        "mpar.profile._fake (layer profile) imports mpar.shard (layer shard, above it)"
    ]
