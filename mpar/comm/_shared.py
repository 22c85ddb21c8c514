"""Pipeline transfers between ranks of one host, through shared memory.

Between two ranks on the same host, a message sent with the backend (gloo over
loopback) is copied into the kernel and out again, and wakes a thread of the backend
on both sides, which competes with the stage's compute for the host's cores. Here
each stream (sender, receiver, tag) is instead a *ring* in a file under
``/dev/shm`` that both ranks map: the sender copies the message in, the receiver
copies it out, and neither side calls the kernel while the other keeps up.

A ring is a byte stream: a write position and a read position (each on its own
cache line) and a data area that the messages pass through in order, wrapping
around. Every message starts with an 8-byte *route*: its size when its bytes follow
in the ring, or a note that this one goes through the backend, because the ring had
no room for it (the receiver has fallen far behind, or the message is larger than
the ring). So a send never waits: like the backend's, it returns at once, and the
schedule's order of sends and receives stays free of deadlocks exactly as it is
with the backend. A note always fits: a message goes in only if room for the next
note is left behind it.

Waiting. A receiver whose next route has not arrived polls for :data:`SPIN_S`
(:data:`SHARED_CORE_SPIN_S` when the host has fewer cores than ranks), and then
sleeps on its *bell*: a FIFO that the sender writes one byte to after a message,
when the receiver's *asleep* flag is set. A sleeper wakes at least every
:data:`NAP_S` even without a bell, so a bell lost in the race between setting the
flag and the sender reading it costs at most that long, never a hang.

Order of memory operations: the sender writes the bytes before it publishes the
new write position, the receiver reads the position before the bytes. x86-64
keeps stores in order and loads in order, which is all this needs; on other
machines mpar uses the backend (see :func:`available`).

Files: each rank makes its flag and its bell at ``mpar.init``; the peers open
them, and the owner removes the names once every peer has. A ring is made by its
sender at the stream's first message and removed by its receiver once opened. No
file outlives its job (:func:`remove_created`, :func:`sweep`): every file is named
``mpar-shm-…`` and held, from the moment it is made until its maker exits, under a
shared ``flock`` that the kernel drops whatever ends the process. Its maker removes
the names it still has at ``mpar.shutdown`` and before the watchdog or a peer's
failure ends the process; whatever a killed job leaves is removed by the next
``mpar.init`` on the host, which takes each such file's lock exclusively (only
possible once no live process holds it) before deleting it. And every file's memory
is reserved before it is mapped (``posix_fallocate``): a ``/dev/shm`` without room
makes a rank run without rings at ``mpar.init``, or one stream go through the
backend (its ring is an empty file, which needs no room), never a SIGBUS when a page
is first touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import select
import socket
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from mpar._device import host_cores
from mpar.comm import _process_state
from mpar.errors import CommError

__all__ = ["PREFIX", "SharedMemory", "available", "connect", "remove_created", "sweep"]

ROOT = "/dev/shm"
PREFIX = "mpar-shm-"
"""Every file of the rings starts with this (and only theirs: :func:`sweep` looks at no other)."""
RING_BYTES = 4 << 20
"""Data area of one stream's ring."""
SMALL_RING_BYTES = 64 << 10
"""Data area of a ring made when ``/dev/shm`` has no room for one of :data:`RING_BYTES`
(a container's is often 64 MiB): messages that do not fit go through the backend."""
_ROUTE_BYTES = 8
_ELSEWHERE = -1
SPIN_S = 1.0
"""How long a waiting rank polls before it sleeps on its bell, when the host has a
core for each of its ranks: a rank that sleeps gives its core back to the host, and
waking it again costs far more than the message (tens to hundreds of microseconds on a
virtual machine), every message on the critical path."""
SHARED_CORE_SPIN_S = 200e-6
"""The same, when ranks share cores: a polling rank would take the core from one that
computes."""
_YIELD_AFTER_S = 20e-6
"""A polling rank yields its core to any other thread that is ready, after this long."""
NAP_S = 2e-3
"""The longest sleep without a bell."""
_HEAD = 256
_WRITE, _READ = 0, 64  # byte offsets of the two positions in a ring's head
_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})


def available() -> bool:
    """Whether this host can run shared-memory rings: a ``/dev/shm`` to map, and a
    processor that keeps stores and loads in program order (x86)."""
    return platform.machine().lower() in _ORDERED_MACHINES and os.access(ROOT, os.W_OK)


_CREATED: set[str] = set()
"""Files this process made and has not removed yet (:func:`remove_created`)."""


def _same(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _remove(path: str) -> None:
    _CREATED.discard(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _open_new(path: str, fifo: bool) -> int:
    if fifo:
        os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


def _create(path: str, size: int = 0, *, fifo: bool = False) -> int:
    """Make the file (or FIFO) ``path`` with ``size`` bytes reserved; its descriptor, which
    holds a shared lock on it while open (see the module docstring). OSError when
    there is no room."""
    for _ in range(100):
        try:
            fd = _open_new(path, fifo)
        except FileExistsError:  # a sweeper has not removed our first try yet
            time.sleep(1e-3)
            continue
        _CREATED.add(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if _same(fd, path):
                break
        except BlockingIOError:  # a sweeper opened it between the two calls: it goes
            pass
        os.close(fd)
        time.sleep(1e-3)
    else:
        raise CommError(f"could not make {path}: another process removes it as it is made")
    try:
        if size:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        _remove(path)
        raise
    return fd


def remove_created() -> None:
    """Remove every file this process made and still has (before the process ends at
    once: a watchdog ending, a peer's failure). Safe from any thread."""
    for path in list(_CREATED):
        _remove(path)


_process_state.register(
    "mpar.comm._shared._CREATED", remove_created, lambda: not _CREATED, teardown=True
)


def sweep(root: str | None = None) -> list[str]:
    """Remove the ring files under ``root`` (``ROOT``) whose every maker is gone: the
    files of jobs that were killed. Returns their names."""
    root = ROOT if root is None else root
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = f"{root}/{name}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or another user's
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its maker runs
            if _same(fd, path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                removed.append(name)
        finally:
            os.close(fd)
    return removed


def _make_ring(path: str) -> tuple[int, mmap.mmap | None]:
    """A new ring at ``path``, its memory reserved (``posix_fallocate``): made under a
    temporary name and renamed, so its receiver never maps it half made. Where
    ``/dev/shm`` has room for neither size, the ring is an empty file: the stream goes
    through the backend (None)."""
    temporary = path + ".new"
    memory = None
    fd, error = -1, None
    for capacity in (RING_BYTES, SMALL_RING_BYTES, 0):
        try:
            fd = _create(temporary, _HEAD + capacity if capacity else 0)
        except OSError as exc:
            error = exc
            continue
        if capacity:
            memory = mmap.mmap(fd, _HEAD + capacity)
        break
    else:
        raise CommError(
            f"cannot make a pipeline transfer ring in {ROOT}, not even an empty file "
            f"({error}); enlarge {ROOT} (docker: --shm-size) or set the config key "
            "'shared_memory' to false"
        )
    os.rename(temporary, path)
    _CREATED.discard(temporary)
    _CREATED.add(path)
    return fd, memory


def _map(path: str, size: int) -> mmap.mmap:
    """Map the existing file ``path`` (made, and reserved, by its owner)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _word(memory: mmap.mmap, offset: int = 0) -> np.ndarray:
    """The 8-byte integer at ``offset`` of ``memory``, as a one-element array on it."""
    return np.frombuffer(memory, dtype="<i8", count=1, offset=offset)


class _Ring:
    """One stream's ring, as one end sees it."""

    __slots__ = ("capacity", "data", "memory", "mine", "peer", "read", "write")

    def __init__(self, memory: mmap.mmap, peer: int) -> None:
        self.memory = memory
        self.write, self.read = _word(memory, _WRITE), _word(memory, _READ)
        self.data = np.frombuffer(memory, dtype=np.uint8, offset=_HEAD)
        self.capacity = self.data.nbytes
        self.peer = peer
        self.mine = 0
        """This end's position (the write position at the sender, the read one at the receiver)."""

    def put(self, source: np.ndarray, position: int) -> int:
        """Copy ``source`` in from ``position`` on (wrapping around); the position after."""
        done, size = 0, source.nbytes
        while done < size:
            at = position % self.capacity
            n = min(size - done, self.capacity - at)
            self.data[at : at + n] = source[done : done + n]
            done += n
            position += n
        return position

    def take(self, target: np.ndarray, position: int) -> int:
        """Copy out into ``target`` from ``position`` on; the position after."""
        done, size = 0, target.nbytes
        while done < size:
            at = position % self.capacity
            n = min(size - done, self.capacity - at)
            target[done : done + n] = self.data[at : at + n]
            done += n
            position += n
        return position


class SharedMemory:
    """This rank's rings to and from its peers on the same host (one per ``mpar.init``)."""

    def __init__(self, token: str, rank: int, peers: Iterable[int], spin_s: float) -> None:
        self.token, self.rank, self.spin_s = token, rank, spin_s
        self.peers = frozenset(peers)
        """Global ranks this rank exchanges pipeline messages with through shared memory."""
        self._rings_out: dict[tuple[int, int], _Ring | None] = {}
        """Stream -> its ring (None: the stream goes through the backend)."""
        self._rings_in: dict[tuple[int, int], _Ring | None] = {}
        self._held: list[int] = []
        """Descriptors of the files this rank made: each holds its file's lock."""
        self._held.append(_create(self._path(rank, "flag"), 64))
        try:
            self._flag = mmap.mmap(self._held[0], 64)
            self._held.append(_create(self._path(rank, "bell"), fifo=True))
        except BaseException:
            self._release_files()
            raise
        self._bell = self._held[1]
        self._asleep = _word(self._flag)
        self._peer_flags: dict[int, np.ndarray] = {}
        self._peer_bells: dict[int, int] = {}
        self._maps: list[mmap.mmap] = []
        self._route = np.zeros(1, dtype="<i8")
        self._route_bytes = self._route.view(np.uint8)

    def _path(self, rank: int, what: str, tag: int | None = None) -> str:
        return f"{ROOT}/{PREFIX}{self.token}-{rank}-{what}" + ("" if tag is None else f"-{tag}")

    def open_peers(self, candidates: Iterable[int]) -> set[int]:
        """Open the flag and bell of each candidate peer; the ones that could be opened."""
        opened = set()
        for peer in candidates:
            try:
                memory = _map(self._path(peer, "flag"), 64)
                bell = os.open(self._path(peer, "bell"), os.O_RDWR | os.O_NONBLOCK)
            except OSError:
                continue
            self._maps.append(memory)
            self._peer_flags[peer] = _word(memory)
            self._peer_bells[peer] = bell
            opened.add(peer)
        return opened

    def keep(self, peers: Iterable[int]) -> None:
        """Use the rings with ``peers`` only (both ends opened each other), and remove
        this rank's own file names: every peer has them open by now."""
        self.peers = frozenset(peers)
        self._remove_names()

    def _remove_names(self) -> None:
        for what in ("flag", "bell"):
            _remove(self._path(self.rank, what))

    # ------------------------------------------------------------------ transfers

    def send(self, buffer: torch.Tensor, dst: int, tag: int) -> bool:
        """Send ``buffer`` (host bytes) to ``dst`` through the ring when it has room for
        it now, and say so (True); else put a note in the ring that this message goes
        through the backend (False), which the caller then sends it with."""
        key = (dst, tag)
        if key not in self._rings_out:
            path = self._path(dst, "ring", tag=self._stream(self.rank, tag))
            fd, memory = _make_ring(path)
            self._held.append(fd)
            self._rings_out[key] = None if memory is None else _Ring(memory, dst)
        ring = self._rings_out[key]
        if ring is None:
            return False
        source = buffer.numpy().reshape(-1)
        size = source.nbytes
        position = ring.mine
        room = ring.capacity - (position - int(ring.read[0]))
        here = room >= size + 2 * _ROUTE_BYTES  # (a note for the next message always fits)
        self._route[0] = size if here else _ELSEWHERE
        position = ring.put(self._route_bytes, position)
        if here:
            position = ring.put(source, position)
        ring.mine = position
        ring.write[0] = position  # (published after the bytes)
        if self._peer_flags[dst][0]:  # it sleeps: wake it
            with contextlib.suppress(BlockingIOError):  # (its bell is full of rings already)
                os.write(self._peer_bells[dst], b"\0")
        return here

    @staticmethod
    def _stream(sender: int, tag: int) -> int:
        return sender * (1 << 24) + tag

    def recv(self, buffer: torch.Tensor, src: int, tag: int) -> bool:
        """Receive the next message of stream (``src``, ``tag``) into ``buffer`` when it
        came through the ring (True); False when it comes through the backend."""
        ring = self._ring_in(src, tag)
        if ring is None:
            return False
        if int(ring.write[0]) == ring.mine:
            self.wait_until(lambda: int(ring.write[0]) != ring.mine)
        position = ring.take(self._route_bytes, ring.mine)
        size = int(self._route[0])
        if size != _ELSEWHERE:
            target = buffer.numpy().reshape(-1)
            if size != target.nbytes:
                raise CommError(
                    f"internal: shared-memory transfer from rank {src} on stream {tag} has "
                    f"{size} bytes, expected {target.nbytes}"
                )
            position = ring.take(target, position)
        ring.mine = position
        ring.read[0] = position
        return size != _ELSEWHERE

    def _ring_in(self, src: int, tag: int) -> _Ring | None:
        key = (src, tag)
        if key not in self._rings_in:
            path = self._path(self.rank, "ring", tag=self._stream(src, tag))
            memory = self._wait_for_file(path)
            _remove(path)
            self._rings_in[key] = None if memory is None else _Ring(memory, src)
        return self._rings_in[key]

    def _wait_for_file(self, path: str) -> mmap.mmap | None:
        """The ring at ``path`` once its sender has made it (at its first message); None
        for an empty file (no room for a ring: the stream goes through the backend)."""
        while True:
            with contextlib.suppress(FileNotFoundError):
                size = os.stat(path).st_size
                return _map(path, size) if size else None
            time.sleep(1e-4)

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()``: poll, then sleep on the bell."""
        start = time.perf_counter()
        polite, until = start + _YIELD_AFTER_S, start + self.spin_s
        while not done():
            now = time.perf_counter()
            if now < until:
                if now > polite:
                    os.sched_yield()
                continue
            self._asleep[0] = 1
            try:
                if not done():
                    ready, _, _ = select.select([self._bell], [], [], NAP_S)
                    if ready:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._bell, 4096)
            finally:
                self._asleep[0] = 0

    def close(self) -> None:
        """Release the maps and the bells, and remove the files this rank made."""
        for ring in (*self._rings_out.values(), *self._rings_in.values()):
            if ring is not None:
                del ring.write, ring.read, ring.data
                ring.memory.close()
        for bell in self._peer_bells.values():
            os.close(bell)
        self._peer_flags.clear()
        del self._asleep
        for memory in (*self._maps, self._flag):
            memory.close()
        for dst, tag in self._rings_out:  # a ring its receiver never opened
            _remove(self._path(dst, "ring", tag=self._stream(self.rank, tag)))
        self._release_files()

    def _release_files(self) -> None:
        """Remove this rank's own names; close the descriptors that hold the locks."""
        self._remove_names()
        for fd in self._held:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._held.clear()


def connect(
    rank: int, peers: list[int], ranks_on_host: int, group: dist.ProcessGroup | None
) -> SharedMemory | None:
    """This rank's rings with those of ``peers`` (global ranks of its pipeline) that
    are on its host and can open its files; None when there is none.

    Collective over the default process group: every rank calls it, in the same
    order, with its own pipeline's peers.
    """
    host = (socket.gethostname(), _boot_id()) if available() else None
    token = uuid.uuid4().hex[:16] if rank == 0 else None
    first: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(first, (token, host), group=group)
    token = first[0][0]  # type: ignore[index]
    local = [p for p in peers if p != rank and host is not None and first[p][1] == host]  # type: ignore[index]
    spin_s = SPIN_S if ranks_on_host <= host_cores() else SHARED_CORE_SPIN_S
    mine = _own_files(str(token), rank, spin_s) if host is not None else None
    opened: set[int] = set()
    second: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(second, mine is not None, group=group)  # every rank's files exist
    if mine is not None:
        opened = mine.open_peers(p for p in local if second[p])
    third: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(third, sorted(opened), group=group)
    if mine is None:
        return None
    both = {p for p in opened if rank in third[p]}  # type: ignore[operator]
    mine.keep(both)
    if not both:
        mine.close()
        return None
    return mine


def _own_files(token: str, rank: int, spin_s: float) -> SharedMemory | None:
    """This rank's flag and bell; None (with a warning) where ``ROOT`` has no room."""
    try:
        return SharedMemory(token, rank, (), spin_s)
    except OSError as exc:
        warnings.warn(
            f"mpar: no room in {ROOT} for rank {rank}'s shared-memory files ({exc.strerror}); "
            "its pipeline transfers go through the backend. Enlarge it (docker: --shm-size)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _boot_id() -> str:
    """What tells two hosts apart when they share a name (containers)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
