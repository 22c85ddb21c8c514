"""Point-to-point transfer of nested values between pipeline ranks.

A *payload* is any nesting of tuples, lists and dicts whose leaves are tensors
or picklable values (ints, strings, None, ...). :func:`send_payload` sends a
small header (the structure, each tensor's shape and dtype, the non-tensor
leaves, and a label saying which stage and microbatch it belongs to) and then
each tensor; :func:`recv_payload` rebuilds the same nesting. Sends are
non-blocking: the returned :class:`PendingSends` keeps the buffers alive until
:meth:`PendingSends.wait`. Each (stage, direction) stream has its own tag, so
activations and gradients between the same two ranks never mix; the label is
checked on receipt, so a schedule mismatch is an error, not silent corruption.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mpar.errors import CommError

__all__ = ["PendingSends", "recv_payload", "send_payload"]


@dataclass
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class PendingSends:
    """Non-blocking sends still in flight (their tensors are kept alive here)."""

    works: list[Any] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        self.buffers.clear()


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``value`` by a slot, appending it to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, tuple | list):
        items = [_flatten(v, tensors) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, _flatten(v, tensors)) for k, v in value.items())
    return value


def _unflatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors.pop(0)
    if isinstance(value, tuple | list):
        items = [_unflatten(v, tensors) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, _unflatten(v, tensors)) for k, v in value.items())
    return value


def _slots(value: Any) -> list[_TensorSlot]:
    found: list[_TensorSlot] = []

    def visit(v: Any) -> None:
        if isinstance(v, _TensorSlot):
            found.append(v)
        elif isinstance(v, tuple | list):
            for item in v:
                visit(item)
        elif isinstance(v, dict):
            for item in v.values():
                visit(item)

    visit(value)
    return found


def send_payload(
    payload: Any, dst: int, tag: int, label: tuple[Any, ...], pending: PendingSends
) -> None:
    """Start sending ``payload`` to global rank ``dst`` on stream ``tag``."""
    tensors: list[torch.Tensor] = []
    structure = _flatten(payload, tensors)
    header = pickle.dumps((label, structure))
    header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    length = torch.tensor([header_bytes.numel()], dtype=torch.int64)
    for buffer in [length, header_bytes] + [t.detach().contiguous() for t in tensors]:
        pending.buffers.append(buffer)
        pending.works.append(dist.isend(buffer, dst, tag=tag))


def recv_payload(src: int, tag: int, label: tuple[Any, ...], device: torch.device) -> Any:
    """Receive what :func:`send_payload` sent from ``src`` on stream ``tag``."""
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src, tag=tag)
    header_bytes = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(header_bytes, src, tag=tag)
    got_label, structure = pickle.loads(header_bytes.numpy().tobytes())
    if tuple(got_label) != tuple(label):
        raise CommError(
            f"pipeline transfer mismatch from rank {src}: expected {label}, received "
            f"{tuple(got_label)}; the ranks are running different schedules"
        )
    tensors = []
    for slot in _slots(structure):
        buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.recv(buffer, src, tag=tag)
        if slot.requires_grad:
            buffer.requires_grad_(True)
        tensors.append(buffer)
    return _unflatten(structure, tensors)
