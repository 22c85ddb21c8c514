"""Where ``save_pretrained`` writes, how it commits, and what a load refuses.

A save into ``parent/out`` never writes into ``out`` itself::

    parent/
      out/                        the committed save: shards, index, config.json,
                                  mpar-complete.json (the files and their sizes)
      .out.mpar-tmp-9f2c.../      a save in progress (or interrupted): never loaded
      .out.mpar-save.lock         held by the save in progress, removed after it

Rank 0 takes the lock (a second writer is refused, naming the first: host, pid,
since when), checks that ``out`` may be replaced, clears interrupted saves and
makes the temporary folder; every rank writes its part there; rank 0 adds the
index, the config and the marker, then swaps the folder in for ``out`` in one
step (:func:`mpar.checkpoint._dirs.replace_dir`) and removes the earlier
content. So ``out`` holds the earlier save, whole, until that step, and the new
one, whole, after it: for ``mpar.load_pretrained`` and for ``transformers``.

``out`` may be replaced when it does not exist, is empty, or holds an earlier
``save_pretrained`` and nothing else (the files its marker lists); anything
else is refused unless ``overwrite=True``, and then replaced whole as well.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from mpar.checkpoint import _dirs
from mpar.checkpoint._common import CheckpointError
from mpar.checkpoint._owner import OWNER, Owner, RootLock, is_stale, write_owner

__all__ = [
    "FORMAT",
    "MARKER",
    "check_committed",
    "claim",
    "commit",
    "lock_path",
    "old_path",
    "write_marker",
]

FORMAT = "mpar-safetensors-v1"
MARKER = _dirs.MARKER
_TMP = ".mpar-tmp-"


def lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}.mpar-save.lock"


def old_path(final: Path) -> Path:
    """Where the earlier content waits during a commit without a one-step swap."""
    return final.parent / f".{final.name}.mpar-old"


def _temporary(final: Path) -> list[Path]:
    prefix = f".{final.name}{_TMP}"
    return [p for p in final.parent.iterdir() if p.name.startswith(prefix)]


def _listed(directory: Path) -> dict[str, int] | None:
    """The files an mpar save's marker lists (name -> bytes), or None without one."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if marker.get("format") != FORMAT or not isinstance(files, dict):
        return None
    return {str(k): int(v) for k, v in files.items()}


def _check_replaceable(final: Path, overwrite: bool) -> None:
    """Raise unless ``final`` may be replaced (see the module docstring)."""
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{str(final)!r} is a file, not a folder: save into a folder")
    if overwrite or not final.exists():
        return
    entries = set(os.listdir(final))
    listed = _listed(final)
    extra = (
        sorted(entries - set(listed or ()) - {MARKER}) if listed is not None else sorted(entries)
    )
    if extra:
        what = "files an earlier save did not write" if listed is not None else "other files"
        raise CheckpointError(
            f"{str(final)!r} holds {what} ({len(extra)}: {extra[:5]}); a save replaces the "
            "folder whole. Pass overwrite=True to replace it, or save into another folder"
        )


def claim(final: Path, overwrite: bool) -> tuple[Path, RootLock]:
    """Rank 0: take ``final``'s lock, check it may be replaced, clear interrupted saves,
    make the temporary folder beside it; returns the folder and the lock."""
    final.parent.mkdir(parents=True, exist_ok=True)
    owner = Owner.here()
    lock = RootLock(final.parent, owner, path=lock_path(final), target="a model into", remove=True)
    try:
        _dirs.restore_dir(final, old_path(final))  # a commit cut between its two renames
        _check_replaceable(final, overwrite)
        for stale in _temporary(final):
            if is_stale(stale):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{final.name}{_TMP}{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        write_owner(tmp, owner)
        return tmp, lock
    except BaseException:
        lock.release()
        raise


def write_marker(tmp: Path, extra: dict[str, Any]) -> None:
    """The marker: every file the save wrote and its bytes, after each is flushed to disk."""
    files = {}
    for name in sorted(os.listdir(tmp)):
        if name != OWNER:
            _fsync(tmp / name)
            files[name] = (tmp / name).stat().st_size
    text = json.dumps({"format": FORMAT, "files": files, **extra}, indent=1)
    _dirs.write_file(tmp / MARKER, text)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Put ``tmp`` (marked) at ``final`` in one step; the earlier content is removed."""
    (tmp / OWNER).unlink(missing_ok=True)
    _dirs.replace_dir(tmp, final, old_path(final))


def check_committed(root: Path) -> None:
    """For loaders: refuse a save that was not committed, and a committed one whose
    files are missing or short (CheckpointError naming the folder or the file)."""
    if root.name.startswith(".") and _TMP in root.name:
        final = root.parent / root.name[1:].split(_TMP)[0]
        raise CheckpointError(
            f"{str(root)!r} is a save_pretrained that was never committed (interrupted, or "
            f"still writing); load {str(final)!r}, which holds the last committed save"
        )
    if not root.exists() and old_path(root).is_dir():
        raise CheckpointError(
            f"{str(root)!r} is missing: a save_pretrained was interrupted while it replaced "
            f"it, and the earlier save waits at {str(old_path(root))!r}. The next "
            "save_pretrained into it puts it back; or rename it yourself"
        )
    listed = _listed(root) if root.is_dir() else None
    for name, size in (listed or {}).items():
        path = root / name
        found = path.stat().st_size if path.is_file() else None
        if found is None or found < size:
            state = "missing" if found is None else f"truncated: {found} of {size} bytes"
            raise CheckpointError(
                f"{str(path)!r}, written by save_pretrained, is {state}; the folder was "
                "changed after its save: save it again"
            )
