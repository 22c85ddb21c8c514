"""Checkpoint directories: where a save writes, how it commits, what a load finds.

A checkpoint root holds one directory per save and a ``latest`` pointer::

    root/
      latest                    "ckpt-000002", replaced atomically, last
      ckpt-000001/              .metadata, __0_0.distcp, ..., mpar-complete.json
      ckpt-000002/
      .tmp-ckpt-000003-9f2c.../ a save in progress (or interrupted): never loaded
      .mpar-save.lock           held by the save in progress

A save writes into a ``.tmp-`` directory that names its owner
(:mod:`mpar.checkpoint._owner`; the save holds the root's lock meanwhile);
once every rank's shards and DCP's ``.metadata`` are on disk and every file
the metadata names is there in full (:mod:`mpar.checkpoint._verify`), rank 0
writes the completion marker, renames the directory to its final name and
then replaces ``latest``, each step flushed to disk. An interruption at any point leaves ``latest`` on the previous
complete checkpoint; a directory without the marker is never loaded.
These are local file operations, run on global rank 0 only.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from mpar.checkpoint._owner import Owner, is_stale, write_owner

__all__ = [
    "LATEST",
    "MARKER",
    "commit",
    "complete_dirs",
    "fsync_dir",
    "replace_dir",
    "is_complete",
    "new_tmp_dir",
    "read_marker",
    "remove_stale",
    "resolve",
    "write_file",
]

LATEST = "latest"
MARKER = "mpar-complete.json"
_NAME = re.compile(r"^(?:\.tmp-)?ckpt-(\d+)")


def _number(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, text: str) -> None:
    """``path`` holds ``text`` at once or not at all (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file() and (directory / ".metadata").is_file()


def read_marker(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / MARKER).read_text()))


def complete_dirs(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    found = [
        (n, p)
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".")
        for n in [_number(p.name)]
        if n is not None and is_complete(p)
    ]
    return [p for _, p in sorted(found)]


def new_tmp_dir(root: Path, owner: Owner | None = None) -> tuple[Path, str]:
    """A new temporary directory under ``root``, owned by ``owner`` (this process by
    default), and the final name it will get (one past every number in use, a
    live save's included)."""
    root.mkdir(parents=True, exist_ok=True)
    numbers = [n for p in root.iterdir() for n in [_number(p.name)] if n is not None]
    name = f"ckpt-{max(numbers, default=0) + 1:06d}"
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    write_owner(tmp, owner or Owner.here())
    return tmp, name


def remove_stale(root: Path) -> list[str]:
    """Delete interrupted saves under ``root`` (``.tmp-`` directories whose owner is
    gone, :func:`mpar.checkpoint._owner.is_stale`); their names. Call it holding
    the root's save lock."""
    if not root.is_dir():
        return []
    temporary = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".tmp-ckpt-")]
    stale = [p for p in temporary if is_stale(p)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def commit(tmp: Path, name: str, marker: dict[str, Any], keep_last: int | None) -> Path:
    """Mark ``tmp`` complete, rename it to ``name``, point ``latest`` at it; then
    delete all but the ``keep_last`` newest complete checkpoints."""
    write_file(tmp / MARKER, json.dumps(marker, indent=1))
    final = tmp.parent / name
    if final.exists():
        raise FileExistsError(f"{str(final)!r} exists already (written by another job?)")
    os.rename(tmp, final)
    fsync_dir(tmp.parent)
    write_file(tmp.parent / LATEST, name + "\n")
    if keep_last is not None:
        for old in complete_dirs(tmp.parent)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(path: Path) -> tuple[str, Path]:
    """What a load of ``path`` reads: ``("file", path)`` for a single-file checkpoint,
    ``("dcp", directory)`` for a complete checkpoint directory. Raises ValueError
    with the reason and the fix."""
    if path.is_file():
        return "file", path
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    if (path / ".metadata").is_file():
        if not is_complete(path):
            raise ValueError(
                f"checkpoint directory {str(path)!r} has no completion marker ({MARKER}): "
                "its save was interrupted. Load the checkpoint root (its 'latest' pointer) "
                "or an earlier complete checkpoint directory"
            )
        return "dcp", path
    return "dcp", _latest(path)


def _latest(root: Path) -> Path:
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if not is_complete(target):
            others = [p.name for p in complete_dirs(root)]
            fix = (
                f"load one of {others} explicitly"
                if others
                else "no complete checkpoint is left under it: save a new one"
            )
            raise ValueError(
                f"{str(pointer)!r} names {target.name!r}, which is not a complete checkpoint "
                f"directory; {fix}"
            )
        return target
    complete = complete_dirs(root)
    if not complete:
        raise ValueError(
            f"{str(root)!r} holds no complete checkpoint (no 'latest' pointer and no "
            "directory with a completion marker); was the first save interrupted?"
        )
    return complete[-1]


# ------------------------------------------------------------ replacing a directory

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    args = (_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    call = getattr(libc, "renameat2", None)
    number = _SYS_RENAMEAT2.get(platform.machine().lower())
    if call is not None:
        result = call(*args)
    elif number is not None and platform.system() == "Linux":
        result = libc.syscall(number, *args)
    else:
        return False
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # (NFS, some FUSE file systems)
    raise OSError(code, f"exchanging {str(a)!r} and {str(b)!r}: {os.strerror(code)}")


def replace_dir(tmp: Path, final: Path, old: Path) -> None:
    """Put the directory ``tmp`` at ``final`` in one step, whatever ``final`` held, and
    remove what it held. Where the file system cannot swap two directories in one step
    (:func:`_exchange`), ``final`` is moved to ``old`` (a name beside it) and ``tmp``
    renamed in its place: a crash between the two renames leaves the earlier content
    at ``old``, which :func:`restore_dir` puts back."""
    leftover = None
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        leftover = tmp  # (now the earlier content, under a name nothing loads)
    else:
        os.rename(final, old)
        os.rename(tmp, final)
        leftover = old
    fsync_dir(final.parent)
    if leftover is not None:
        shutil.rmtree(leftover, ignore_errors=True)


def restore_dir(final: Path, old: Path) -> bool:
    """After a crash inside :func:`replace_dir` that left ``final`` missing: put the
    earlier content (at ``old``) back; whether it did."""
    if final.exists() or not old.is_dir():
        return False
    os.rename(old, final)
    fsync_dir(final.parent)
    return True
