"""NCCL's point-to-point rules, enforced on gloo: a transport for tests.

With the config key ``nccl_rules`` (or built directly, as the tests of torch's own
schedules do), pipeline transfers go through :class:`NcclRules` instead of gloo's
tagged sends and receives. It behaves as NCCL's point-to-point operations do under
torch's ProcessGroupNCCL, so that an order that would hang or corrupt on GPUs fails
on the CPU first, with a message that says why:

* **Tags are ignored.** Between two ranks, the k-th send one posts to the other
  matches the k-th receive the other posts from it, whatever either meant.
* **One queue per pair.** A rank's operations with one peer (sends and receives)
  run one after another in posting order: an operation starts only once every
  earlier one with that peer has completed.
* **A send completes only once matched**: when the peer's matching receive has
  started (reached the head of the peer's queue), not when the bytes are handed over.
* **Groups.** Operations posted together (:meth:`NcclRules.post` with several, as
  ``batch_isend_irecv`` does) progress together; the group leaves the queues once all
  of them have completed.
* **Matching is checked.** A send and the receive it is matched with must agree in
  dtype and shape; otherwise both sides raise :class:`~mpar.errors.CommError` naming
  both (NCCL would deliver the wrong bytes, or wait forever).
* **Deadlocks are reported.** Each rank tells its peers what its queue with them
  waits for; when two ranks' queues wait for each other (each head needs an operation
  the other posted behind its own head, or not at all while its thread waits), both
  raise a :class:`~mpar.errors.CommError` within a fraction of a second instead of
  hanging. (Cycles through three or more ranks are left to mpar's hang watchdog.)

How. A gloo process group of its own carries two kinds of messages: fixed-size
*control* words (``READY``: a receive reached the head of its queue, with its dtype
and shape; ``DATA``: the bytes of a send follow; ``STATE``: what a queue waits for;
``MISMATCH``; ``DEADLOCK``: found one with the receiving rank; ``STOP``) and the *data* of each transfer, which goes straight into the
receiving tensor. A listener thread on every rank takes the control words, so queues
progress while the main thread computes or waits in a collective, as NCCL's do on
the GPU. Slow, and meant to be: every transfer costs three messages.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mpar.errors import CommError

__all__ = ["Group", "NcclRules", "P2P"]

P2P = tuple[bool, int, torch.Tensor, str]
"""One operation to post: (send?, peer's rank in the group, tensor, what it is, in words)."""

_WORDS = 64
_TAG_CONTROL, _TAG_DATA = 1, 2
_READY, _DATA, _STATE, _MISMATCH, _DEADLOCK, _STOP = 1, 2, 3, 4, 5, 6
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 16
_MAX_HEAD = (_WORDS - 8) // 2
_POLL_S = 0.05
_CONFIRM_S = 0.2
"""A deadlock is reported once it has been seen twice this far apart with nothing new
from the peer in between."""
Meta = tuple[int, ...]
"""A tensor's dtype code, number of dimensions and shape."""
Key = tuple[bool, int]
"""An operation with a peer: (send?, its index among this rank's sends to the peer, or
receives from it)."""


def _meta(tensor: torch.Tensor) -> Meta:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise CommError(
            f"nccl_rules: cannot transfer a {tensor.dtype} tensor with {tensor.dim()} "
            f"dimensions (dtypes: {', '.join(str(d) for d in _DTYPES)}; up to {_MAX_DIMS} dims)"
        )
    return (_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape)


def _describe(meta: Sequence[int]) -> str:
    dtype = _DTYPES[meta[0]] if 0 <= meta[0] < len(_DTYPES) else f"dtype #{meta[0]}"
    shape = ", ".join(str(s) for s in meta[2 : 2 + meta[1]])
    return f"{str(dtype).removeprefix('torch.')} [{shape}]"


@dataclass(eq=False)
class _Op:
    send: bool
    peer: int
    seq: int
    tensor: torch.Tensor
    """The user's tensor (a receive writes into it)."""
    wire: torch.Tensor
    """Its bytes, flat (a copy for a send of a non-contiguous tensor)."""
    meta: Meta
    what: str
    group: Group
    done: bool = False
    active: bool = False
    """At the head of its queue: its receive is posted / its send may go."""
    work: dist.Work | None = None
    error: str | None = None

    @property
    def key(self) -> Key:
        return (self.send, self.seq)

    def describe(self, rank: int) -> str:
        kind, way = ("send", "to") if self.send else ("receive", "from")
        what = f"; {self.what}" if self.what else ""
        return f"rank {rank}'s {kind} #{self.seq} {way} rank {self.peer} ({_describe(self.meta)}{what})"


class Group:
    """Operations posted together; what :meth:`NcclRules.post` returns (a ``Work``)."""

    def __init__(self, rules: NcclRules) -> None:
        self._rules = rules
        self.ops: list[_Op] = []

    def is_completed(self) -> bool:
        return all(op.done for op in self.ops)

    def wait(self, timeout: object = None) -> bool:
        """Block until every operation of the group has completed; raise a
        :class:`~mpar.errors.CommError` on a mismatch or a deadlock."""
        self._rules.wait(self)
        return True


@dataclass
class _PeerState:
    """What a peer last said about its queue with this rank."""

    posted: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    """Sends (True) and receives it posted with this rank."""
    front: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    """Per kind, the first sequence number behind its head (those before are done or in it)."""
    head: frozenset[Key] = frozenset()
    """Its head's operations not completed yet."""
    blocked: Key | None = None
    """The operation with this rank that its main thread waits for."""


@dataclass
class _Pair:
    """This rank's queue with one peer, and what it knows of the peer's."""

    queue: deque[list[_Op]] = field(default_factory=deque)
    sends: int = 0
    receives: int = 0
    pending: dict[Key, _Op] = field(default_factory=dict)
    """Posted operations not completed yet."""
    ready: dict[int, Meta] = field(default_factory=dict)
    """READY words received for sends, by sequence number."""
    peer: _PeerState | None = None
    published: tuple[object, ...] | None = None
    suspected: float | None = None
    """When a deadlock with this peer was first seen (confirmed a moment later)."""


class NcclRules:
    """This rank's NCCL-rules transport over ``group`` (a gloo group; its ranks name peers)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self._pg, self.rank, self.size = group, rank, size
        self._cond = threading.Condition()
        self._pairs: dict[int, _Pair] = {}
        self._blocked: _Op | None = None
        self._failure: str | None = None
        self._sent: list[tuple[dist.Work, torch.Tensor]] = []
        self._thread = threading.Thread(target=self._listen, name="mpar-nccl-rules", daemon=True)
        self._thread.start()

    # -- posting and waiting (the caller's thread) ----------------------------------------

    def post(self, ops: Sequence[P2P]) -> Group:
        """Post ``ops`` as one group (one operation: an ordinary ``isend``/``irecv``)."""
        with self._cond:
            self._raise_failure()
            group = Group(self)
            units: dict[int, list[_Op]] = {}
            for send, peer, tensor, what in ops:
                pair = self._pair(peer)
                seq = pair.sends if send else pair.receives
                if send:
                    pair.sends += 1
                else:
                    pair.receives += 1
                flat = tensor.detach().reshape(-1)
                if send and not flat.is_contiguous():
                    flat = flat.contiguous()
                wire = flat.view(torch.uint8) if flat.dtype != torch.bool else flat
                op = _Op(send, peer, seq, tensor, wire, _meta(tensor), what, group)
                group.ops.append(op)
                pair.pending[op.key] = op
                units.setdefault(peer, []).append(op)
            for peer, unit in units.items():
                self._pairs[peer].queue.append(unit)
            self._progress()
        return group

    def wait(self, group: Group) -> None:
        try:
            self._wait(group)
        except CommError:
            self._flush()  # what this rank told its peers reaches them before it stops
            raise
        for op in group.ops:  # the bytes of a send are out before its tensor is reused
            if op.send and op.work is not None:
                op.work.wait()

    def _wait(self, group: Group) -> None:
        with self._cond:
            try:
                while True:
                    failed = next((op for op in group.ops if op.error), None)
                    if failed is not None:
                        raise CommError(failed.error)
                    self._raise_failure()
                    waiting = next((op for op in group.ops if not op.done), None)
                    if waiting is None:
                        return
                    if self._blocked is not waiting:
                        self._blocked = waiting
                        self._publish()
                    self._check_deadlock(waiting.peer)
                    self._cond.wait(_POLL_S)
            finally:
                if self._blocked is not None and self._failure is None:
                    self._blocked = None  # (a rank that failed stays blocked to its peers)
                    self._publish()

    def _flush(self) -> None:
        with self._cond:
            sent, self._sent = self._sent, []
        for work, _ in sent:
            with contextlib.suppress(RuntimeError):  # a peer that is gone
                work.wait()

    def close(self) -> None:
        """Stop the listener (every rank calls it, after the last transfer): each rank
        stops the next one's."""
        if self.size > 1:
            self._control((self.rank + 1) % self.size, [_STOP])
        self._thread.join(timeout=5.0)

    # -- the queues (under the lock) ----------------------------------------------------

    def _pair(self, peer: int) -> _Pair:
        if not 0 <= peer < self.size or peer == self.rank:
            raise CommError(f"nccl_rules: rank {self.rank} cannot transfer with rank {peer}")
        pair = self._pairs.get(peer)
        if pair is None:
            pair = self._pairs[peer] = _Pair()
        return pair

    def _progress(self) -> None:
        """Retire completed heads, start the operations of new ones; tell the peers."""
        changed = True
        while changed:
            changed = False
            for pair in self._pairs.values():
                while pair.queue and all(op.done for op in pair.queue[0]):
                    if not pair.queue[0][0].group.is_completed():
                        break  # a group leaves the queues once all of it has completed
                    pair.queue.popleft()
                    changed = True
                for op in pair.queue[0] if pair.queue else ():
                    if not op.active:
                        self._activate(op, pair)
                        changed = True
        self._publish()
        self._cond.notify_all()

    def _activate(self, op: _Op, pair: _Pair) -> None:
        op.active = True
        if op.send:
            if op.seq in pair.ready:
                self._start_send(op, pair)
            return
        op.work = self._pg.recv([op.wire], op.peer, _TAG_DATA)
        self._control(op.peer, [_READY, op.seq, *op.meta])

    def _start_send(self, op: _Op, pair: _Pair) -> None:
        wanted = pair.ready.pop(op.seq)
        if wanted != op.meta:
            op.error = (
                f"nccl_rules: {op.describe(self.rank)} was matched with rank {op.peer}'s "
                f"receive #{op.seq} from rank {self.rank}, which expects "
                f"{_describe(wanted)}: the two ranks post their transfers in different "
                "orders (NCCL would deliver the wrong bytes or hang)"
            )
            self._control(op.peer, [_MISMATCH, op.seq, *op.meta])
            self._finish(op, pair)
            return
        op.work = self._pg.send([op.wire], op.peer, _TAG_DATA)
        self._control(op.peer, [_DATA, op.seq])
        self._finish(op, pair)

    def _finish(self, op: _Op, pair: _Pair) -> None:
        op.done = True
        pair.pending.pop(op.key, None)

    def _control(self, peer: int, words: list[int]) -> None:
        message = torch.zeros(_WORDS, dtype=torch.int64)
        message[: len(words)] = torch.tensor(words, dtype=torch.int64)
        try:
            self._sent.append((self._pg.send([message], peer, _TAG_CONTROL), message))
        except RuntimeError:  # the peer is gone: its own failure is the news
            return
        if len(self._sent) > 256:  # long since delivered: let their buffers go
            done, self._sent = self._sent[:128], self._sent[128:]
            for work, _ in done:
                work.wait()

    def _publish(self) -> None:
        """Tell each peer what this rank's queue with it waits for, when that changed."""
        for peer, pair in self._pairs.items():
            first = pair.queue[0] if pair.queue else ()
            head = sorted(op.key for op in first if not op.done)[:_MAX_HEAD]
            behind = [op.key for op in pair.pending.values() if op not in first]
            front = [
                min((seq for send, seq in behind if send == kind), default=count)
                for kind, count in ((True, pair.sends), (False, pair.receives))
            ]
            blocked = self._blocked.key if self._blocked and self._blocked.peer == peer else None
            state = (pair.sends, pair.receives, *front, tuple(head), blocked)
            if state == pair.published:
                continue
            pair.published = state
            b = (-1, -1) if blocked is None else (int(blocked[0]), blocked[1])
            flat = [x for key in head for x in (int(key[0]), key[1])]
            words = [_STATE, pair.sends, pair.receives, *front, *b, len(head), *flat]
            self._control(peer, words)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise CommError(self._failure)

    # -- the listener thread -------------------------------------------------------------

    def _listen(self) -> None:
        buffer = torch.zeros(_WORDS, dtype=torch.int64)
        while True:
            try:
                work = self._pg.recv_anysource([buffer], _TAG_CONTROL)
                work.wait()
                src = work._source_rank()
            except Exception:  # the group is gone (shutdown after a failure)
                return
            words = buffer.tolist()
            if words[0] == _STOP:
                return
            try:
                self._handle(src, words)
            except Exception as exc:  # reported to the waiting thread
                with self._cond:
                    self._failure = f"nccl_rules: rank {self.rank}'s listener failed: {exc!r}"
                    self._cond.notify_all()

    def _handle(self, src: int, words: list[int]) -> None:
        kind, seq = words[0], words[1]
        receive = None
        with self._cond:
            pair = self._pair(src)
            if kind == _READY:
                pair.ready[seq] = tuple(words[2 : 4 + words[3]])
                op = pair.pending.get((True, seq))
                if op is not None and op.active:
                    self._start_send(op, pair)
            elif kind == _DATA:
                receive = pair.pending.get((False, seq))
            elif kind == _MISMATCH:
                op = pair.pending[(False, seq)]
                op.error = (
                    f"nccl_rules: {op.describe(self.rank)} was matched with rank {src}'s send "
                    f"#{seq}, which sends {_describe(words[2:])}: the two ranks post their "
                    "transfers in different orders (NCCL would deliver the wrong bytes or hang)"
                )
                self._finish(op, pair)
            elif kind == _STATE:
                self._take_state(pair, words)
            elif kind == _DEADLOCK and self._failure is None:
                self._failure = (
                    f"nccl_rules: deadlock between ranks {self.rank} and {src} under NCCL's "
                    f"point-to-point rules, found by rank {src} (see its error): each rank's "
                    "queue with the other waits for an operation the other posted behind its "
                    "own head. Post both sides' transfers in one order derived from the "
                    "schedule, crossing sends and receives together as one group"
                )
            self._progress()
        if receive is not None and receive.work is not None:
            receive.work.wait()  # the bytes were sent before the word that says so
            with self._cond:
                self._finish(receive, pair)
                self._progress()

    @staticmethod
    def _take_state(pair: _Pair, words: list[int]) -> None:
        sends, receives, send_front, receive_front, b_send, b_seq, n = words[1:8]
        head = frozenset((bool(words[8 + 2 * i]), words[9 + 2 * i]) for i in range(n))
        blocked = None if b_send < 0 else (bool(b_send), b_seq)
        posted = {True: sends, False: receives}
        pair.peer = _PeerState(posted, {True: send_front, False: receive_front}, head, blocked)
        pair.suspected = None

    # -- deadlocks between two ranks ------------------------------------------------------

    def _check_deadlock(self, peer: int) -> None:
        pair = self._pairs.get(peer)
        blocked = self._blocked if self._blocked and self._blocked.peer == peer else None
        if pair is None or pair.peer is None or not _deadlocked(pair, blocked):
            if pair is not None:
                pair.suspected = None
            return
        now = time.monotonic()
        if pair.suspected is None:
            pair.suspected = now
        elif now - pair.suspected >= _CONFIRM_S:
            self._failure = self._deadlock_message(peer, pair)
            self._control(peer, [_DEADLOCK])  # the peer fails too, even if it saw less
            raise CommError(self._failure)

    def _deadlock_message(self, peer: int, pair: _Pair) -> str:
        mine = [op for op in (pair.queue[0] if pair.queue else ()) if not op.done]
        head = "; ".join(op.describe(self.rank) for op in mine)
        heads = sorted(pair.peer.head) if pair.peer else []
        theirs = ", ".join(f"its {'send' if s else 'receive'} #{seq}" for s, seq in heads)
        waiting = (
            f" (this rank waits for {self._blocked.describe(self.rank)})" if self._blocked else ""
        )
        return (
            f"nccl_rules: deadlock between ranks {self.rank} and {peer} under NCCL's "
            f"point-to-point rules: the next operation of rank {self.rank}'s queue with rank "
            f"{peer} is {head}{waiting}, and rank {peer}'s queue with rank {self.rank} waits "
            f"at {theirs}; each needs an operation the other posted behind its own head (or "
            "will not post while it waits). Post both sides' transfers in one order derived "
            "from the schedule, crossing sends and receives together as one group"
        )


def _deadlocked(pair: _Pair, blocked: _Op | None) -> bool:
    """Whether this rank's head with a peer and the peer's head with it wait for each
    other: each head has an operation whose match cannot start before the other head
    completes (posted behind it, or not posted while the other's thread waits for its
    own queue). ``blocked``: the operation with this peer that this rank's main thread
    waits for, if any."""
    peer = pair.peer
    if peer is None or not pair.queue or not peer.head:
        return False
    head = [op for op in pair.queue[0] if not op.done]
    in_head = {op.key for op in head}
    own_posted = {True: pair.sends, False: pair.receives}
    mine_stuck = theirs_stuck = True  # the greatest fixed point: assume, then refute

    def blocked_by_peer(key: Key) -> bool:
        send, seq = not key[0], key[1]
        if (send, seq) in peer.head or seq < peer.front[send]:
            return False  # started, or done (its bytes on the way)
        return True if seq < peer.posted[send] else theirs_stuck

    def blocked_by_me(key: Key) -> bool:
        match = (not key[0], key[1])
        if match[1] >= own_posted[match[0]]:
            return mine_stuck
        return match in pair.pending and match not in in_head

    while True:
        head_blocked = any(blocked_by_peer(op.key) for op in head)
        peer_head_blocked = any(blocked_by_me(key) for key in peer.head)
        mine = blocked is not None and (
            blocked_by_peer(blocked.key) if blocked.key in in_head else head_blocked
        )
        theirs = peer.blocked is not None and (
            blocked_by_me(peer.blocked) if peer.blocked in peer.head else peer_head_blocked
        )
        if (mine, theirs) == (mine_stuck, theirs_stuck):  # (decreasing: ends in 3 rounds)
            return head_blocked and peer_head_blocked
        mine_stuck, theirs_stuck = mine, theirs
