"""Every module-level piece of mutable process state in ``mpar`` is in the one list of
``mpar.comm._process_state``: registered (``shutdown`` resets it) or named there as kept
on purpose. Found over the source with ``ast``: names a function rebinds with
``global``, and module-level objects something mutates (a method call other than a
read, an item or attribute store, ``next()``)."""

from __future__ import annotations

import ast
from pathlib import Path

import mpar
from mpar.comm import _process_state

KEPT = {
    "mpar.comm._lifecycle._STORE",
    "mpar.comm._lifecycle._GENERATION",
    "mpar.comm._process_state._PIECES",
    "mpar.runtime._split_backward._DEFERRING",
    "mpar.partition._manual._assignments",
    "mpar.partition._manual._state",
    "mpar.partition._manual._Hook",
    "mpar.partition._traced._compiled",
    "mpar.testing._CONTEXT",
    "mpar._streams._cuda",
    "mpar._streams._installed",
    "mpar._device._debugging",
    "mpar.testing.streams._LOGS",
}
"""Kept for the process's lifetime, each named in ``_process_state``'s docstring."""

_READS = {
    "copy", "count", "format", "fullmatch", "get", "index", "is_set", "items", "keys",
    "match", "recent", "search", "split", "sub", "values", "wait", "is_fresh",
}  # fmt: skip
"""Methods that only read the object they are called on."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
    return names


def _stored_base(target: ast.expr) -> str | None:
    """``X`` of ``X[...] = ``, ``X.attr = `` or ``del X[...]``."""
    if isinstance(target, ast.Subscript | ast.Attribute) and isinstance(target.value, ast.Name):
        return target.value.id
    return None


def _function_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node inside a function (what runs after import)."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [node for f in functions for node in ast.walk(f)]


def _mutated(tree: ast.Module) -> set[str]:
    """Top-level names that code in the module's functions mutates or rebinds (a class:
    only by storing to its attributes; calling its methods makes instances)."""
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    found: set[str] = set()
    for node in _function_nodes(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                name = func.value.id
                if func.attr not in _READS and not func.attr.startswith("__"):
                    found.update({name} - classes)
            elif isinstance(func, ast.Name) and func.id == "next" and node.args:
                found.update(a.id for a in node.args[:1] if isinstance(a, ast.Name))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            found.update(b for t in targets if (b := _stored_base(t)) is not None)
    return found & _top_level_names(tree)


def _process_state_found() -> set[str]:
    root = Path(mpar.__file__).parent
    out: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = _module_name(path, root)
        out |= {f"{module}.{name}" for name in _mutated(tree)}
    return out


def _listed(name: str, registered: set[str]) -> bool:
    """``name`` is registered itself, or its module is (a piece of several names)."""
    return name in registered or name.rsplit(".", 1)[0] in registered


def test_every_piece_of_process_state_is_registered_or_kept_on_purpose():
    registered = {p.name for p in _process_state.pieces()}
    found = _process_state_found()
    unlisted = sorted(n for n in found if not _listed(n, registered) and n not in KEPT)
    assert unlisted == [], (
        "module-level process state that mpar.shutdown does not reset: register it in "
        f"mpar.comm._process_state (or list it there as kept): {unlisted}"
    )
    assert KEPT <= found  # each kept name is still there (else drop it from the lists)


def test_the_docstring_lists_every_piece():
    doc = _process_state.__doc__ or ""
    for piece in _process_state.pieces():
        assert f"``{piece.name}``" in doc, piece.name
    for name in KEPT:
        assert f"``{name}``" in doc, name


def test_the_finder_sees_globals_and_mutated_objects():
    source = (
        "import threading\n"
        "A = []\nB = {}\nC = threading.Event()\nD = 0\nE = {'k': 1}\nF = []\n"
        "def f():\n    global D\n    D += 1\n    A.append(1)\n    B['x'] = 2\n    C.set()\n"
        "    return E.get('k'), len(F)\n"
    )
    assert _mutated(ast.parse(source)) == {"A", "B", "C", "D"}
