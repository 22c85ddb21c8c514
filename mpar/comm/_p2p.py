"""Point-to-point transfer of nested values between pipeline ranks, in NCCL's order.

A *payload* is any nesting of tuples, lists and dicts whose leaves are tensors
or picklable values (ints, strings, None, ...). :func:`send_payload` sends it;
the receiver posts its receive with :func:`post_payload` and rebuilds the same
nesting with :func:`take_payload` (:func:`recv_payload` does both). Sends are
non-blocking: the returned :class:`PendingSends` keeps the buffers alive until
:meth:`PendingSends.wait`.

Order, not tags. Between two ranks there is one stream of messages in each
direction, as under NCCL (which ignores tags): the k-th message one rank sends to
another is the k-th the other receives from it. The runtime posts sends and
receives in an order both ends derive from the schedule
(:func:`mpar.schedule.receive_posts`), which is free of deadlocks under NCCL's
rules; gloo, the shared-memory rings and the ``nccl_rules`` test transport
(:mod:`mpar.comm._nccl_rules`) carry that same order. Every message of a pair has
tag 0.

Agreement. Each transfer is named by its :class:`~mpar.comm._types.TransferLabel`
(which stage and microbatch, activations or gradients). The first time a label
travels within a *step signature* (what its shapes follow from: the model, the step
function and the shapes and dtypes of its inputs, see ``runtime._transfers``), both ends
record its *spec*: the nesting, each tensor's shape and dtype, the non-tensor
leaves. From then on both know each message's size before it is sent
(:meth:`Links.begin` picks the signature's specs at the start of a step).

Wire format.

* **New** (a label's first transfer in a signature): a 64-byte control block (kind
  ``NEW``, header and data lengths, the label), then one message with the pickled
  header padded to 16 bytes and the data. The receiver reads the control block
  where it posts the receive (its sender has sent it by then: that is how the
  posting order is built), then posts the body.
* **Steady, host memory**: one message, the control block (kind ``SAME``, the data
  length, the label: checked on receipt, read through numpy for nothing) followed by
  the data. A stage's messages of up to 1 MiB are written again once sent (a fresh
  buffer costs a page fault per page); host messages are written through numpy
  views made once (after a stage's compute has evicted the caches, every torch call
  costs tens of microseconds).
* **Steady, device memory** (and under ``nccl_rules``, which runs this path on the
  CPU): the data alone, into a buffer of the agreed size; the host reads nothing.
  A payload of one contiguous tensor goes as it is, without a copy; a payload
  without tensor data (no gradient) sends nothing at all.

Data: every tensor's bytes, at 16-byte aligned offsets. A payload that differs from
its label's spec in a later step of the same signature is refused with an error
(shapes between stages must follow from the step's inputs).

Between ranks of one host, host messages go through shared-memory rings instead
(:mod:`mpar.comm._shared`, :meth:`Links.send` and :meth:`Links.recv` choose): the
same messages, in the same order, through one ring per direction; a ring needs no
posted receive, so its receives are taken in order when waited for.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from mpar import _device
from mpar._tree import tree_leaves, tree_map
from mpar.comm._nccl_rules import NcclRules
from mpar.comm._progress import Waiting
from mpar.comm._shared import SharedMemory
from mpar.comm._types import Transfer, TransferLabel
from mpar.errors import CommError, StepError

__all__ = [
    "Incoming",
    "Links",
    "PendingSends",
    "post_payload",
    "recv_payload",
    "send_payload",
    "take_payload",
]

TAG = 0
"""The tag of every pipeline message (NCCL ignores tags; order is what matches)."""
_CONTROL_BYTES = 64
_CONTROL_WORDS = _CONTROL_BYTES // 8
_LABEL_WORDS = len(TransferLabel._fields)  # after: kind, header bytes, data bytes, label length
_TRANSFERS = frozenset(int(t) for t in Transfer)
_ALIGN = 16
_SAME, _NEW = 1, 2
_SIGNATURES = 8
"""Step signatures whose specs are kept (the oldest is dropped, on every rank alike)."""


class Receive(Protocol):
    """A posted receive: ``wait()`` returns once its bytes are in the buffer."""

    def wait(self) -> object: ...


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class _Spec:
    """What both ends agreed about one label's transfers."""

    structure: object
    """The payload's nesting with :class:`_TensorSlot` leaves."""
    slots: list[_TensorSlot]
    offsets: list[int]
    data: int
    """Bytes of the data section."""


_REUSE_BYTES = 1 << 20
"""Messages up to this size are reused once sent: a fresh host buffer of a few hundred
KiB costs a page fault per page when it is first written, more than packing into it."""
_REUSE_DEPTH = 4
"""Sent messages kept for reuse per stream (peer, direction, stage)."""


@dataclass
class PendingSends:
    """Non-blocking sends still in flight (their tensors are kept alive here)."""

    works: list[Receive | None] = field(default_factory=list)
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
        links: Links,
        pool: list[Any] | None = None,
        keep: object = None,
        what: str = "",
    ) -> None:
        """Send ``buffer``; once sent, ``keep`` (default: ``buffer``) goes back to ``pool``
        (when given) for reuse. Sends already done are let go first (:meth:`collect`)."""
        self.collect()
        self.buffers.append(buffer if keep is None else keep)
        self.works.append(links.send(buffer, dst, what))
        self.peers.append(dst)
        self.pools.append(pool)

    def collect(self) -> None:
        """Let go of every send that is done: its message back to its stream's pool for
        reuse, or freed. Called at every send and every receive (``runtime._transfers``),
        so a step holds the messages still on their way, at most the microbatches in
        flight, not every message it sent."""
        kept = 0
        for work, buffer, dst, pool in zip(self.works, self.buffers, self.peers, self.pools):
            if _done(work):
                _keep_for_reuse(buffer, pool)
                continue
            self.works[kept], self.buffers[kept] = work, buffer
            self.peers[kept], self.pools[kept] = dst, pool
            kept += 1
        del self.works[kept:], self.buffers[kept:], self.peers[kept:], self.pools[kept:]

    def reclaim(self, pool: list[Any]) -> None:
        """Move the buffers of ``pool``'s stream whose sends are done back into it."""
        for i in range(len(self.buffers) - 1, -1, -1):
            if self.pools[i] is pool and _done(self.works[i]):
                _keep_for_reuse(self.buffers[i], pool)
                del self.works[i], self.buffers[i], self.peers[i], self.pools[i]


def _done(work: Receive | None) -> bool:
    """Whether a send is complete (None: it went into a shared-memory ring at once)."""
    return work is None or bool(getattr(work, "is_completed", lambda: False)())


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
    """A steady-state host message (control block + data) kept for reuse by its
    stream, written through numpy views made once."""

    __slots__ = ("data", "tensor", "words")

    def __init__(self, size: int, device: torch.device) -> None:
        self.tensor = torch.empty(size, dtype=torch.uint8, device=device)
        array = self.tensor.numpy()
        self.words: np.ndarray = array[:_CONTROL_BYTES].view("<i8")
        self.data: np.ndarray = array[_CONTROL_BYTES:]

    def write(
        self, data: int, label: TransferLabel, tensors: list[torch.Tensor], offsets: list[int]
    ) -> None:
        """The control words of a SAME message and the tensors' bytes."""
        control = _control_words(_SAME, 0, data, label)
        self.words[: len(control)] = control
        array = self.data
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


class _RingReceive:
    """A receive through a shared-memory ring: taken, in its pair's order, when waited
    for (a ring needs no posted receive)."""

    __slots__ = ("buffer", "done", "links", "src")

    def __init__(self, links: Links, buffer: torch.Tensor, src: int) -> None:
        self.links, self.buffer, self.src, self.done = links, buffer, src, False

    def wait(self) -> None:
        self.links._take_in_order(self.src, self)


class Links:
    """This rank's pipeline streams, shared by every transfer of one ``mpar.init``: the
    transports, the specs agreed per step signature, and sent messages for reuse."""

    def __init__(self) -> None:
        self.shared: SharedMemory | None = None
        """The shared-memory rings to the peers on this host (``mpar.init`` sets them up
        when transfers are on the host and the ``shared_memory`` key allows it)."""
        self.rules: NcclRules | None = None
        """The NCCL-rules test transport (config key ``nccl_rules``), or None."""
        self.agreed: dict[TransferLabel, _Spec] = {}
        """The specs of the running step's signature (:meth:`begin`)."""
        self._specs: dict[Hashable, dict[TransferLabel, _Spec]] = {}
        self._complete: set[Hashable] = set()
        self._signature: Hashable = None
        self._pools: dict[tuple[int, int, int], list[_Message]] = {}
        self._in_order: dict[int, deque[_RingReceive]] = {}

    # -- steps --------------------------------------------------------------------------

    def begin(self, signature: Hashable) -> None:
        """Use the specs agreed for ``signature`` (none yet: this step agrees them). Every
        rank of a pipeline calls it with the same signatures in the same order."""
        if signature not in self._complete:
            self._specs.pop(signature, None)
            if len(self._specs) >= _SIGNATURES:
                oldest = next(iter(self._specs))
                del self._specs[oldest]
                self._complete.discard(oldest)
            self._specs[signature] = {}
        self.agreed = self._specs[signature]
        self._signature = signature

    def end(self) -> None:
        """The step finished: its signature's specs are complete."""
        self._complete.add(self._signature)

    def labelled(self, device: torch.device) -> bool:
        """Whether steady messages on ``device`` carry control words (host memory, not
        under ``nccl_rules``, which runs the device path)."""
        return self.rules is None and _device.is_host(device)

    # -- transports ---------------------------------------------------------------------

    def _shared(self, peer: int, device: torch.device) -> SharedMemory | None:
        """The rings when messages on ``device`` to or from ``peer`` go through them."""
        shared = self.shared
        if shared is not None and peer in shared.peers and _device.is_host(device):
            return shared
        return None

    def send(self, buffer: torch.Tensor, dst: int, what: str = "") -> Receive | None:
        """Start sending the bytes of ``buffer`` to ``dst`` (the next message of the pair);
        None when they are sent already (into a shared-memory ring)."""
        if self.rules is not None:
            return self.rules.post([(True, dst, buffer, what)])
        shared = self._shared(dst, buffer.device)
        if shared is not None and shared.send(buffer, dst, TAG):
            return None
        return _world().send([buffer], dst, TAG)

    def recv(self, buffer: torch.Tensor, src: int, what: str = "") -> Receive:
        """Post the receive of the next message from ``src`` into ``buffer``."""
        if self.rules is not None:
            return self.rules.post([(False, src, buffer, what)])
        if self._shared(src, buffer.device) is not None:
            receive = _RingReceive(self, buffer, src)
            self._in_order.setdefault(src, deque()).append(receive)
            return receive
        return _world().recv([buffer], src, TAG)

    def _take_in_order(self, src: int, until: _RingReceive) -> None:
        """Take the messages from ``src`` into their posted buffers, in order, up to
        ``until`` (one that found no room in the ring comes through the backend)."""
        shared, queue = self.shared, self._in_order[src]
        while not until.done:
            receive = queue.popleft()
            if shared is None or not shared.recv(receive.buffer, src, TAG):
                _world().recv([receive.buffer], src, TAG).wait()
            receive.done = True

    def pool(self, dst: int, label: TransferLabel) -> list[_Message]:
        """Sent messages of ``label``'s stream (to ``dst``) ready to be written again."""
        key = (dst, int(label.kind), label.stage)
        found = self._pools.get(key)
        if found is None:
            found = self._pools[key] = []
        return found

    def close(self) -> None:
        """Release the shared-memory rings and the test transport (``mpar.shutdown``)."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.rules is not None:
            self.rules.close()
            self.rules = None


# -- payloads as bytes ------------------------------------------------------------------


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
    """Each tensor's byte offset in the data section (16-byte aligned), and the section's
    size (up to the last tensor's end: one tensor's data is its bytes exactly)."""
    offsets, end = [], 0
    for slot in slots:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + _nbytes(slot)
    return offsets, end


def _spec(structure: object) -> _Spec:
    slots = _slots(structure)
    offsets, data = _offsets(slots)
    return _Spec(structure, slots, offsets, data)


def _control_words(kind: int, header: int, data: int, label: TransferLabel) -> tuple[int, ...]:
    """A control block's words: kind, header and data lengths, then the label."""
    return (kind, header, data, _LABEL_WORDS, *label)


def _write_control(
    message: torch.Tensor, kind: int, header: int, data: int, label: TransferLabel
) -> None:
    """The control words into the first bytes of ``message`` (straight through numpy
    on the host; elsewhere from a host tensor)."""
    words = _control_words(kind, header, data, label)
    if _device.on_host(message):
        message[:_CONTROL_BYTES].numpy().view("<i8")[: len(words)] = words
    else:
        host = torch.zeros(_CONTROL_WORDS, dtype=torch.int64)
        host[: len(words)] = torch.tensor(words, dtype=torch.int64)
        message[:_CONTROL_BYTES].view(torch.int64).copy_(host)


def _read_control(message: torch.Tensor) -> list[int]:
    if _device.on_host(message):  # (numpy: fewer calls, see _Message)
        return list(message.numpy()[:_CONTROL_BYTES].view("<i8").tolist())
    with _device.counted_wait("p2p control words"):  # read from the device before the body
        return list(message[:_CONTROL_BYTES].view(torch.int64).tolist())


def _label_in(words: list[int]) -> TransferLabel | None:
    """The label a control block carries (None when its words are no label)."""
    fields = words[4 : 4 + _LABEL_WORDS]
    if words[3] != _LABEL_WORDS or fields[0] not in _TRANSFERS:
        return None
    return TransferLabel(Transfer(fields[0]), *fields[1:])


def _check_label(words: list[int], label: TransferLabel, src: int) -> None:
    got = _label_in(words)
    if got != label:
        sent = "an unlabelled message" if got is None else got.describe()
        raise CommError(
            f"pipeline transfer mismatch: rank {dist.get_rank()} expected "
            f"{label.describe()} from rank {src}, but rank {src} sent "
            f"{sent}; the two ranks run different schedules (give every "
            "rank the same config: microbatches, pipeline, virtual_stages; and call the same "
            "steps in the same order)"
        )


def _pack(
    buffer: torch.Tensor, start: int, tensors: list[torch.Tensor], offsets: list[int]
) -> None:
    for tensor, offset in zip(tensors, offsets):
        flat = tensor.detach().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        target = buffer[start + offset : start + offset + nbytes]
        target.view(flat.dtype).copy_(flat)


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


def _same_structure(structure: object, spec: _Spec) -> bool:
    try:
        return bool(structure == spec.structure)
    except Exception:  # a leaf without a plain ==: compare the pickles
        return pickle.dumps(structure) == pickle.dumps(spec.structure)


# -- sending ----------------------------------------------------------------------------


def send_payload(
    payload: object,
    dst: int,
    label: TransferLabel,
    pending: PendingSends,
    links: Links,
    device: torch.device | None = None,
) -> None:
    """Start sending ``payload`` to global rank ``dst`` as the transfer ``label``.

    The message is built on ``device`` (default: the payload's first tensor's
    device, else the CPU): the device the backend sends from. A steady device
    message of one contiguous tensor is that tensor's memory: it must not change
    until the send is done (``pending.wait()``), as with torch's own ``isend``.
    """
    tensors: list[torch.Tensor] = []
    structure = _flatten(payload, tensors)
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    spec = links.agreed.get(label)
    if spec is None:
        _send_new(structure, tensors, dst, label, pending, links, device)
    elif not _same_structure(structure, spec):
        raise StepError(
            f"{label.describe()} (to rank {dst}) is {_shown(structure)}, but it was "
            f"{_shown(spec.structure)} in the first step with these inputs: pipeline "
            "transfers are agreed once per step signature (the model, the step function "
            "and its inputs' shapes and dtypes), so what a stage sends must follow from those "
            "(pad data-dependent shapes to a fixed size)"
        )
    elif links.labelled(device):
        _send_labelled(tensors, spec, dst, label, pending, links, device)
    else:
        _send_data(tensors, spec, dst, label, pending, links, device)


def _shown(structure: object) -> str:
    def slot(s: _TensorSlot) -> str:
        return f"{str(s.dtype).removeprefix('torch.')}{list(s.shape)}"

    return str(tree_map(slot, structure, leaf=_TensorSlot)).replace("'", "")


def _send_new(
    structure: object,
    tensors: list[torch.Tensor],
    dst: int,
    label: TransferLabel,
    pending: PendingSends,
    links: Links,
    device: torch.device,
) -> None:
    """A label's first transfer in this signature: control block, then header + data."""
    spec = links.agreed[label] = _spec(structure)
    header = pickle.dumps(structure)
    start = -(-len(header) // _ALIGN) * _ALIGN
    control = torch.zeros(_CONTROL_BYTES, dtype=torch.uint8, device=device)
    _write_control(control, _NEW, len(header), spec.data, label)
    body = torch.empty(start + spec.data, dtype=torch.uint8, device=device)
    body[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    _pack(body, start, tensors, spec.offsets)
    what = label.describe()
    pending.add(control, dst, links, what=f"{what}: control block")
    pending.add(body, dst, links, what=f"{what}: header and data")


def _send_labelled(
    tensors: list[torch.Tensor],
    spec: _Spec,
    dst: int,
    label: TransferLabel,
    pending: PendingSends,
    links: Links,
    device: torch.device,
) -> None:
    """Steady host message: control block + data, in a reused buffer where one is free."""
    size = _CONTROL_BYTES + spec.data
    reuse = size <= _REUSE_BYTES
    free = links.pool(dst, label)
    if reuse and not free:
        pending.reclaim(free)
    message = None
    while free and message is None:
        kept = free.pop()  # (one of another size or device is dropped)
        tensor = kept.tensor
        message = kept if tensor.numel() == size and tensor.device == device else None
    if message is None:
        message = _Message(size, device)
    message.write(spec.data, label, tensors, spec.offsets)
    pending.add(message.tensor, dst, links, free if reuse else None, keep=message)


def _send_data(
    tensors: list[torch.Tensor],
    spec: _Spec,
    dst: int,
    label: TransferLabel,
    pending: PendingSends,
    links: Links,
    device: torch.device,
) -> None:
    """Steady device message: the data alone (a lone contiguous tensor as it is)."""
    if spec.data == 0:
        return  # nothing to send, and the receiver knows it
    lone = tensors[0].detach() if len(tensors) == 1 else None
    if lone is not None and lone.is_contiguous() and lone.device == device:
        message = lone.reshape(-1).view(torch.uint8)
    else:
        message = torch.empty(spec.data, dtype=torch.uint8, device=device)
        _pack(message, 0, tensors, spec.offsets)
    pending.add(message, dst, links, what=label.describe())


# -- receiving --------------------------------------------------------------------------


@dataclass
class Incoming:
    """A posted receive of one transfer (:func:`post_payload`), taken by :func:`take_payload`."""

    src: int
    label: TransferLabel
    message: torch.Tensor
    receive: Receive | None
    """None when nothing comes (a steady device transfer without data)."""
    spec: _Spec | None
    """None for a label's first transfer: the header in the message says it."""
    start: int
    """Where the data begin in ``message``."""
    header: int = 0
    """Bytes of the pickled header (first transfers)."""


def post_payload(src: int, label: TransferLabel, device: torch.device, links: Links) -> Incoming:
    """Post the receive of the transfer ``label`` from global rank ``src`` into a buffer
    on ``device``. For a label's first transfer in this signature it waits for the
    control block, which its sender has sent by now in the order the runtime posts
    (``mpar.schedule.receive_posts``), and posts the body."""
    spec = links.agreed.get(label)
    what = label.describe()
    if spec is None:
        control = torch.empty(_CONTROL_BYTES, dtype=torch.uint8, device=device)
        with Waiting(("recv", src, label)):
            links.recv(control, src, f"{what}: control block").wait()
        words = _read_control(control)
        _check_label(words, label, src)
        if words[0] != _NEW:
            raise CommError(f"internal: {what} from rank {src} came as a steady message")
        header, data = words[1], words[2]
        start = -(-header // _ALIGN) * _ALIGN
        body = torch.empty(start + data, dtype=torch.uint8, device=device)
        return Incoming(src, label, body, links.recv(body, src, what), None, start, header)
    start = _CONTROL_BYTES if links.labelled(device) else 0
    message = torch.empty(start + spec.data, dtype=torch.uint8, device=device)
    if message.numel() == 0:
        return Incoming(src, label, message, None, spec, 0)
    return Incoming(src, label, message, links.recv(message, src, what), spec, start)


def take_payload(incoming: Incoming, links: Links) -> object:
    """Wait for a posted transfer and rebuild what was sent."""
    src, label, message = incoming.src, incoming.label, incoming.message
    if incoming.receive is not None:
        with Waiting(("recv", src, label)):
            incoming.receive.wait()
    spec = incoming.spec
    if spec is None:
        structure = pickle.loads(message[: incoming.header].cpu().numpy().tobytes())
        spec = links.agreed[label] = _spec(structure)
    elif incoming.start:  # a labelled steady message: check what came
        words = _read_control(message)
        _check_label(words, label, src)
        if words[0] != _SAME or words[2] != spec.data:
            raise CommError(
                f"internal: {label.describe()} from rank {src} has {words[2]} data bytes "
                f"(kind {words[0]}), expected {spec.data}"
            )
    tensors = _unpack(message, incoming.start, spec.slots, spec.offsets)
    return _unflatten(spec.structure, tensors[::-1])


def recv_payload(src: int, label: TransferLabel, device: torch.device, links: Links) -> object:
    """Post and take the transfer ``label`` from ``src`` (:func:`post_payload`,
    :func:`take_payload`)."""
    return take_payload(post_payload(src, label, device, links), links)
