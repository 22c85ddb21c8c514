"""Who is saving into a checkpoint root: the root's save lock and each save's owner.

Two jobs saving into one root must not destroy each other's work. A save
holds the root's lock (``root/.mpar-save.lock``, an exclusive ``fcntl.flock``
taken by global rank 0) from the moment it clears interrupted saves until its
commit, so a second live writer is refused with the first one's identity.
``save_pretrained`` locks its folder the same way, with a file beside it. The
lock file and every temporary directory name their owner (host, pid, process
start time): an interrupted save is one whose owner is gone — a dead pid on
this host — and only those are cleared. A directory owned by another host
(a file system shared by several nodes, where the lock may not reach) counts
as interrupted once nothing in it has changed for :data:`STALE_AFTER_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mpar.errors import MparError

__all__ = [
    "LOCK",
    "OWNER",
    "STALE_AFTER_S",
    "Owner",
    "RootLock",
    "SaveInProgressError",
    "is_stale",
    "write_owner",
]

LOCK = ".mpar-save.lock"
OWNER = "mpar-owner.json"
STALE_AFTER_S = 3600.0
"""A save directory of another host with no file changed for this long is stale."""


class SaveInProgressError(MparError, RuntimeError):
    """Another live job is saving into the same checkpoint root."""


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot; Linux), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Owner:
    """The process that owns a save: ``host``, ``pid``, its start ticks, ``since``."""

    host: str
    pid: int
    start: int | None
    since: float

    @classmethod
    def here(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _start_ticks(pid), time.time())

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        try:
            raw: dict[str, Any] = json.loads(text)
            return cls(str(raw["host"]), int(raw["pid"]), raw.get("start"), float(raw["since"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def alive(self) -> bool | None:
        """Whether the owner still runs: known on this host, None on another."""
        if self.host != socket.gethostname():
            return None
        if not _pid_alive(self.pid):
            return False
        return self.start is None or _start_ticks(self.pid) in (None, self.start)

    def __str__(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host!r}, saving since {started}"


def _last_change(directory: Path) -> float:
    times = [directory.stat().st_mtime]
    with contextlib.suppress(OSError):
        times += [p.stat().st_mtime for p in directory.iterdir()]
    return max(times)


def is_stale(directory: Path) -> bool:
    """Whether the save that wrote ``directory`` is gone (see the module docstring).
    A directory without an owner file was left by an earlier mpar: stale."""
    try:
        owner = Owner.parse((directory / OWNER).read_text())
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if owner is None:
        return True
    alive = owner.alive()
    if alive is None:
        return time.time() - _last_change(directory) > STALE_AFTER_S
    return not alive


def write_owner(directory: Path, owner: Owner) -> None:
    (directory / OWNER).write_text(owner.to_json())


class RootLock:
    """The exclusive save lock of a checkpoint ``root``, held until :meth:`release`.

    Raises :class:`SaveInProgressError` naming the holder when another live
    process holds it. ``path``: the lock file, when not ``root/.mpar-save.lock``
    (``save_pretrained`` locks a folder with a file beside it, since the folder
    itself is replaced); ``target`` names what is saved in the message. With
    ``remove=True`` the file is deleted at :meth:`release`: a process that opened
    it just before sees, once it holds the lock, that the name now refers to
    another file (or none), and takes the lock again.
    """

    def __init__(
        self,
        root: Path,
        owner: Owner,
        *,
        path: Path | None = None,
        target: str = "a checkpoint into",
        remove: bool = False,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path = path if path is not None else root / LOCK
        self.remove = remove
        self._fd: int | None = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_of(fd)
                os.close(fd)
                raise SaveInProgressError(
                    f"another job is saving {target} {str(root)!r} "
                    f"({holder or 'owner unknown'}): two jobs saving into one place would "
                    "destroy each other's work. Wait for it to finish, stop it, or "
                    "save into another directory"
                ) from None
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # removed by the holder that released it: take the new one
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, owner.to_json().encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if self.remove:
                os.unlink(self.path)
            else:
                os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _holder_of(fd: int, wait_s: float = 2.0) -> Owner | None:
    """Who holds the lock file ``fd``: the holder writes its name just after it takes the
    lock, so an empty file is read again for up to ``wait_s`` before giving up."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = Owner.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        if holder is not None or time.monotonic() > deadline:
            return holder
        time.sleep(0.02)
