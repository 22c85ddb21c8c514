"""Point-to-point transfer of nested values between pipeline ranks.

A *payload* is any nesting of tuples, lists and dicts whose leaves are tensors
or picklable values (ints, strings, None, ...). :func:`send_payload` sends it
and :func:`recv_payload` rebuilds the same nesting on the other rank. Sends are
non-blocking: the returned :class:`PendingSends` keeps the buffers alive until
:meth:`PendingSends.wait`. Each (peer, tag) *stream* carries one kind of
transfer (a stage's activations, or its gradients), so activations and
gradients between the same two ranks never mix.

Wire format. Every transfer starts with a 64-byte control block: a kind
(``SAME``/``NEW``), the header and data lengths, and the transfer's
:class:`~mpar.comm._types.TransferLabel` (which stage and microbatch it belongs
to), checked on receipt, so a schedule mismatch
is an error, not silent corruption. The *header* (the nesting, each tensor's
shape and dtype, the non-tensor leaves) is pickled; the *data* is every tensor's
bytes, packed at 16-byte aligned offsets. Both ends of a stream remember the
last header it carried (:class:`Links`, one per ``mpar.init``):

* same header as last time (the steady state: microbatch after microbatch of
  the same shapes): **one message**, control block + data, into a buffer whose
  size the receiver already knows — so it can post the receive early
  (:meth:`Links.post`) and the bytes arrive while it computes;
* new header: the control block (padded to the size the receiver expects),
  then one message with header + data.

Sender and receiver update their memory of a stream with the same transfer,
in the same order, so they always agree on the next message's size.

The steady state costs little on either side: the sender recognises a payload
that is a plain tuple of tensors with the same shapes as last time without
pickling its header, writes the control words and the data straight into the
message (in host memory through numpy views made when the message was allocated:
after a stage's compute has evicted the caches, every torch call costs tens of
microseconds), and both ends keep the data section's offsets; a stream's messages of
up to 1 MiB are written again once sent (a fresh buffer costs a page fault per page); messages go to
the default process group's ``send``/``recv`` without ``torch.distributed``'s
per-call checks.

Between ranks of one host, host messages go through shared-memory rings instead
(:mod:`mpar.comm._shared`, :meth:`Links.send` and :meth:`Links.recv` choose): the
same messages, copied into a ring that both ranks map; a ring needs no posted receive.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mpar import _device
from mpar._tree import tree_leaves, tree_map
from mpar.comm._progress import Waiting
from mpar.comm._shared import SharedMemory
from mpar.comm._types import Transfer, TransferLabel, Work
from mpar.errors import CommError

__all__ = ["Links", "PendingSends", "recv_payload", "send_payload"]

_CONTROL_BYTES = 64
_CONTROL_WORDS = _CONTROL_BYTES // 8
_LABEL_WORDS = len(TransferLabel._fields)  # after: kind, header bytes, data bytes, label length
_TRANSFERS = frozenset(int(t) for t in Transfer)
_ALIGN = 16
_SAME, _NEW = 1, 2


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


_REUSE_BYTES = 1 << 20
"""Messages up to this size are reused once sent: a fresh host buffer of a few hundred
KiB costs a page fault per page when it is first written, more than packing into it."""
_REUSE_DEPTH = 4
"""Sent messages kept for reuse per stream."""


@dataclass
class PendingSends:
    """Non-blocking sends still in flight (their tensors are kept alive here)."""

    works: list[dist.Work | None] = field(default_factory=list)
    buffers: list[object] = field(default_factory=list)
    """What each send keeps alive: its tensor, or the :class:`_Message` that holds it."""
    peers: list[int] = field(default_factory=list)
    pools: list[list[Any] | None] = field(default_factory=list)
    """Where each buffer goes once its send is done (None: nowhere, it is dropped)."""

    def wait(self) -> None:
        for work, dst in zip(self.works, self.peers):
            if work is not None:
                with Waiting(("send", dst, None)):
                    work.wait()
        for buffer, pool in zip(self.buffers, self.pools):
            _keep_for_reuse(buffer, pool)
        self.works.clear()
        self.buffers.clear()
        self.peers.clear()
        self.pools.clear()

    def add(
        self,
        buffer: torch.Tensor,
        dst: int,
        tag: int,
        links: Links,
        pool: list[Any] | None = None,
        keep: object = None,
    ) -> None:
        """Send ``buffer``; once sent, ``keep`` (default: ``buffer``) goes back to ``pool``
        (when given) for reuse."""
        self.buffers.append(buffer if keep is None else keep)
        self.works.append(links.send(buffer, dst, tag))
        self.peers.append(dst)
        self.pools.append(pool)

    def reclaim(self, pool: list[Any]) -> None:
        """Move the buffers of ``pool``'s stream whose sends are done back into it."""
        for i in range(len(self.buffers) - 1, -1, -1):
            work = self.works[i]
            if self.pools[i] is pool and (work is None or work.is_completed()):
                _keep_for_reuse(self.buffers[i], pool)
                del self.works[i], self.buffers[i], self.peers[i], self.pools[i]


def _keep_for_reuse(buffer: object, pool: list[Any] | None) -> None:
    """A sent message back to its stream's ``pool`` (unless it has none, or it is full)."""
    if pool is not None and len(pool) < _REUSE_DEPTH:
        pool.append(buffer)


_NUMPY_DTYPES = frozenset(
    {
        torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool,
    }
)  # fmt: skip
"""dtypes that numpy can copy (bfloat16 and complex numbers it cannot)."""


class _Message:
    """A steady-state message (control block + data) kept for reuse by its stream; in
    host memory it is written through numpy views made once: after a stage's compute
    has evicted the caches, each torch call on the way costs tens of microseconds."""

    __slots__ = ("data", "tensor", "words")

    def __init__(self, size: int, device: torch.device) -> None:
        self.tensor = torch.empty(size, dtype=torch.uint8, device=device)
        if _device.on_host(self.tensor):
            array = self.tensor.numpy()
            self.words: np.ndarray | None = array[:_CONTROL_BYTES].view("<i8")
            self.data: np.ndarray | None = array[_CONTROL_BYTES:]
        else:
            self.words = self.data = None

    def write(
        self, data: int, label: TransferLabel, tensors: list[torch.Tensor], offsets: list[int]
    ) -> None:
        """The control words of a SAME message and the tensors' bytes."""
        words, array = self.words, self.data
        if words is None or array is None:
            _write_control(self.tensor, _SAME, 0, data, label)
            _pack(self.tensor, _CONTROL_BYTES, tensors, offsets)
            return
        control = _control_words(_SAME, 0, data, label)
        words[: len(control)] = control
        for tensor, offset in zip(tensors, offsets):
            source = _flat_numpy(tensor)
            if source is None:
                _pack(self.tensor, _CONTROL_BYTES, [tensor], [offset])
            else:
                np.copyto(array[offset : offset + source.nbytes].view(source.dtype), source)


def _flat_numpy(tensor: torch.Tensor) -> np.ndarray | None:
    """``tensor`` flattened as a numpy array (its own memory where it can), or None when
    numpy cannot hold it: on a device, bfloat16, complex, a negative or conjugate bit."""
    if tensor.dtype not in _NUMPY_DTYPES or not _device.on_host(tensor):
        return None
    try:
        return tensor.detach().numpy().reshape(-1)
    except RuntimeError:
        return None


def _world() -> dist.ProcessGroup:
    """The default process group, whose ranks are the global ranks."""
    world = dist.group.WORLD
    if not isinstance(world, dist.ProcessGroup):
        raise CommError("internal: pipeline transfers need torch.distributed initialised")
    return world


@dataclass
class _Sent:
    """What the sender knows of a stream: the receiver's next expected message size."""

    header: bytes | None = None
    expect: int = _CONTROL_BYTES
    structure: object = None
    """The last header as a structure, when it was a plain tuple of tensors (a payload
    with the same one is recognised without pickling it)."""
    offsets: list[int] = field(default_factory=list)
    data: int = 0
    free: list[_Message] = field(default_factory=list)
    """Sent steady-state messages (control + data) ready to be written again."""


@dataclass
class _Received:
    """What the receiver knows of a stream: the last header and a posted receive."""

    structure: object = None
    """The last header: the payload's nesting with :class:`_TensorSlot` leaves."""
    slots: list[_TensorSlot] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    expect: int = _CONTROL_BYTES
    posted: tuple[Work | None, torch.Tensor] | None = None


class Links:
    """Per-stream memory of both directions, shared by every transfer of one ``mpar.init``."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, int], _Sent] = {}
        self._received: dict[tuple[int, int], _Received] = {}
        self.shared: SharedMemory | None = None
        """The shared-memory rings to the peers on this host (``mpar.init`` sets them up
        when transfers are on the host and the ``shared_memory`` key allows it)."""

    def _shared(self, peer: int, device: torch.device) -> SharedMemory | None:
        """The rings when messages on ``device`` to or from ``peer`` go through them."""
        shared = self.shared
        if shared is not None and peer in shared.peers and _device.is_host(device):
            return shared
        return None

    def send(self, buffer: torch.Tensor, dst: int, tag: int) -> dist.Work | None:
        """Start sending the bytes of ``buffer`` to ``dst`` on stream ``tag``; None
        when they are sent already (into a shared-memory ring)."""
        shared = self._shared(dst, buffer.device)
        if shared is not None and shared.send(buffer, dst, tag):
            return None
        return _world().send([buffer], dst, tag)

    def recv(self, buffer: torch.Tensor, src: int, tag: int) -> None:
        """Receive the next message of stream (``src``, ``tag``) into ``buffer``."""
        shared = self._shared(src, buffer.device)
        if shared is None or not shared.recv(buffer, src, tag):
            _world().recv([buffer], src, tag).wait()

    def close(self) -> None:
        """Release the shared-memory rings (``mpar.shutdown``)."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def sent(self, dst: int, tag: int) -> _Sent:
        link = self._sent.get((dst, tag))
        if link is None:
            link = self._sent[(dst, tag)] = _Sent()
        return link

    def received(self, src: int, tag: int) -> _Received:
        link = self._received.get((src, tag))
        if link is None:
            link = self._received[(src, tag)] = _Received()
        return link

    def post(self, src: int, tag: int, device: torch.device) -> None:
        """Start receiving the next transfer on stream (``src``, ``tag``) now.

        The bytes then arrive in the background; :func:`recv_payload` takes them.
        Posting twice for the same stream before receiving is a no-op, and so is
        posting on a shared-memory ring (its messages wait in the ring, or say that
        they come through the backend).
        """
        link = self.received(src, tag)
        if link.posted is None and self._shared(src, device) is None:
            buffer = torch.empty(link.expect, dtype=torch.uint8, device=device)
            link.posted = (_world().recv([buffer], src, tag), buffer)


def _flatten(value: object, tensors: list[torch.Tensor]) -> object:
    """Replace every tensor in ``value`` by a slot, appending it to ``tensors``."""

    def to_slot(t: torch.Tensor) -> _TensorSlot:
        tensors.append(t)
        return _TensorSlot(tuple(t.shape), t.dtype, t.requires_grad)

    return tree_map(to_slot, value)


def _unflatten(value: object, tensors: list[torch.Tensor]) -> object:
    """Rebuild ``value``, taking tensors for its slots from the end of ``tensors`` reversed."""
    return tree_map(lambda _: tensors.pop(), value, leaf=_TensorSlot)


def _slots(value: object) -> list[_TensorSlot]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, _TensorSlot)]


def _nbytes(slot: _TensorSlot) -> int:
    numel = 1
    for size in slot.shape:
        numel *= size
    return numel * slot.dtype.itemsize


def _offsets(slots: list[_TensorSlot]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the data section (16-byte aligned), and its size."""
    offsets, end = [], 0
    for slot in slots:
        offsets.append(end)
        end += -(-_nbytes(slot) // _ALIGN) * _ALIGN
    return offsets, end


def _control_words(kind: int, header: int, data: int, label: TransferLabel) -> tuple[int, ...]:
    """A control block's words: kind, header and data lengths, then the label."""
    return (kind, header, data, _LABEL_WORDS, *label)


def _control(kind: int, header: int, data: int, label: TransferLabel) -> torch.Tensor:
    return torch.tensor(_control_words(kind, header, data, label), dtype=torch.int64)


def _write_control(
    message: torch.Tensor, kind: int, header: int, data: int, label: TransferLabel
) -> None:
    """The control words into the first bytes of ``message`` (straight through numpy
    on the host; elsewhere from a host tensor)."""
    if _device.on_host(message):
        words = _control_words(kind, header, data, label)
        message[:_CONTROL_BYTES].numpy().view("<i8")[: len(words)] = words
    else:
        message[:_CONTROL_BYTES].view(torch.int64).copy_(_control(kind, header, data, label))


def _plain(structure: object) -> bool:
    """Whether a payload's structure is a plain tuple of tensor slots (and Nones), so
    that ``==`` between two of them means their pickled headers are equal."""
    return type(structure) is tuple and all(
        type(leaf) is _TensorSlot or leaf is None for leaf in structure
    )


def _label_in(words: list[int]) -> TransferLabel | None:
    """The label a control block carries (None when its words are no label)."""
    fields = words[4 : 4 + _LABEL_WORDS]
    if words[3] != _LABEL_WORDS or fields[0] not in _TRANSFERS:
        return None
    return TransferLabel(Transfer(fields[0]), *fields[1:])


def _pack(
    buffer: torch.Tensor, start: int, tensors: list[torch.Tensor], offsets: list[int]
) -> None:
    for tensor, offset in zip(tensors, offsets):
        flat = tensor.detach().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        target = buffer[start + offset : start + offset + nbytes]
        target.view(flat.dtype).copy_(flat)


def send_payload(
    payload: object,
    dst: int,
    tag: int,
    label: TransferLabel,
    pending: PendingSends,
    links: Links,
    device: torch.device | None = None,
) -> None:
    """Start sending ``payload`` to global rank ``dst`` on stream ``tag``.

    The message is built on ``device`` (default: the payload's first tensor's
    device, else the CPU): the device the backend sends from.
    """
    tensors: list[torch.Tensor] = []
    structure = _flatten(payload, tensors)
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    link = links.sent(dst, tag)
    plain = _plain(structure)
    same = plain and link.structure is not None and structure == link.structure
    header = b""
    if not same:
        header = pickle.dumps(structure)
        same = header == link.header
        if not same:
            link.offsets, link.data = _offsets(_slots(structure))
    offsets, data = link.offsets, link.data
    if same:  # one message: control + data
        size = _CONTROL_BYTES + data
        reuse = size <= _REUSE_BYTES
        if reuse and not link.free:
            pending.reclaim(link.free)
        message = None
        while link.free and message is None:
            kept = link.free.pop()  # (one of another size or device is dropped)
            tensor = kept.tensor
            message = kept if tensor.numel() == size and tensor.device == device else None
        if message is None:
            message = _Message(size, device)
        message.write(data, label, tensors, offsets)
        pending.add(message.tensor, dst, tag, links, link.free if reuse else None, keep=message)
        return
    start = -(-len(header) // _ALIGN) * _ALIGN
    control = torch.zeros(link.expect, dtype=torch.uint8, device=device)
    _write_control(control, _NEW, len(header), data, label)
    body = torch.empty(start + data, dtype=torch.uint8, device=device)
    body[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    _pack(body, start, tensors, offsets)
    pending.add(control, dst, tag, links)
    pending.add(body, dst, tag, links)
    link.header, link.expect = header, _CONTROL_BYTES + data
    link.structure = structure if plain else None


def _unpack(
    buffer: torch.Tensor,
    start: int,
    slots: list[_TensorSlot],
    offsets: list[int] | None = None,
) -> list[torch.Tensor]:
    """The tensors of ``slots``, read from ``buffer`` from byte ``start`` on.

    A lone tensor is a view of the buffer. Several tensors get a storage each:
    views of one buffer would share its autograd version counter (an in-place
    operation on one received tensor would invalidate every other one saved for
    backward) and would keep the whole message alive while any one of them is.
    """
    if offsets is None:
        offsets, _ = _offsets(slots)
    tensors = []
    for slot, offset in zip(slots, offsets):
        begin = start + offset
        flat = buffer[begin : begin + _nbytes(slot)].view(slot.dtype)
        tensor = flat.reshape(slot.shape) if len(slots) == 1 else flat.clone().reshape(slot.shape)
        if slot.requires_grad:
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return tensors


def recv_payload(
    src: int, tag: int, label: TransferLabel, device: torch.device, links: Links
) -> object:
    """Receive what :func:`send_payload` sent from ``src`` on stream ``tag``."""
    link = links.received(src, tag)
    with Waiting(("recv", src, label)):
        if link.posted is not None:
            work, message = link.posted
            link.posted = None
            if work is not None:
                work.wait()
        else:
            message = torch.empty(link.expect, dtype=torch.uint8, device=device)
            links.recv(message, src, tag)
    if _device.on_host(message):  # (numpy: fewer calls, see _Message)
        words = message.numpy()[:_CONTROL_BYTES].view("<i8").tolist()
    else:
        words = message[:_CONTROL_BYTES].view(torch.int64).tolist()
    kind, header_bytes, data = words[0], words[1], words[2]
    got_label = _label_in(words)
    if got_label != label:
        sent = "an unlabelled message" if got_label is None else got_label.describe()
        raise CommError(
            f"pipeline transfer mismatch: rank {dist.get_rank()} expected "
            f"{label.describe()} from rank {src}, but rank {src} sent "
            f"{sent}; the two ranks run different schedules (give every "
            "rank the same config: microbatches, pipeline, virtual_stages; and call the same "
            "steps in the same order)"
        )
    if kind == _SAME:
        if _CONTROL_BYTES + data != message.numel():
            raise CommError(
                f"internal: transfer from rank {src} on stream {tag} has {data} data bytes, "
                f"expected {message.numel() - _CONTROL_BYTES}"
            )
        tensors = _unpack(message, _CONTROL_BYTES, link.slots, link.offsets)
        return _unflatten(link.structure, tensors[::-1])
    start = -(-header_bytes // _ALIGN) * _ALIGN
    body = torch.empty(start + data, dtype=torch.uint8, device=device)
    with Waiting(("recv", src, label)):
        links.recv(body, src, tag)
    link.structure = pickle.loads(body[:header_bytes].cpu().numpy().tobytes())
    link.slots = _slots(link.structure)
    link.offsets, _ = _offsets(link.slots)
    link.expect = _CONTROL_BYTES + data
    return _unflatten(link.structure, _unpack(body, start, link.slots, link.offsets)[::-1])
