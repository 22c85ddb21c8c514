"""Activation accounting of one step: the bytes kept for backward, and their peak.

What a rank keeps between a stage's forward and its backward is the stage's
inputs and outputs (held by the run) and what autograd saved inside the stage.
The latter is counted with :class:`_SavedBytes` (saved-tensor hooks) on the first
forward of each input signature of a stage and reused after, since the hooks
cost about as much as a third of a small stage's forward on the CPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from mpar import _device
from mpar._compat import top_saved_tensors_hooks
from mpar._tree import tree_leaves
from mpar.comm import _process_state

__all__ = ["ActivationMemory", "counting_only", "storage_bytes", "tensor_bytes"]

_SAVED_BYTES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], int]] = (
    weakref.WeakKeyDictionary()
)
"""Stage -> {input signature: bytes autograd saved inside its forward}."""
_process_state.register(
    "mpar.runtime._activations._SAVED_BYTES", _SAVED_BYTES.clear, lambda: not _SAVED_BYTES
)
_HELD_FOR_W: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], int]] = (
    weakref.WeakKeyDictionary()
)
"""Stage -> {input signature: bytes a split backward's I leaves for the W}."""
_process_state.register(
    "mpar.runtime._activations._HELD_FOR_W", _HELD_FOR_W.clear, lambda: not _HELD_FOR_W
)
_SIGNATURES_KEPT = 64


def _remember(known: dict[tuple[object, ...], int], key: tuple[object, ...], nbytes: int) -> None:
    """``known[key] = nbytes``, forgetting the oldest signature when ``_SIGNATURES_KEPT``
    are already known."""
    if len(known) >= _SIGNATURES_KEPT:
        known.pop(next(iter(known)))
    known[key] = nbytes


SavedHooks = tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor]]
"""A ``saved_tensors_hooks`` pair: (pack, unpack)."""


def tensor_bytes(value: object) -> int:
    """Bytes of the storages of the tensors in ``value`` (a nesting of them)."""
    return sum(
        t.untyped_storage().nbytes() for t in tree_leaves(value) if isinstance(t, torch.Tensor)
    )


def storage_bytes(tensors: Iterable[torch.Tensor], excluded: set[int]) -> int:
    """Bytes of the distinct storages of ``tensors`` (views count once), leaving out
    those in ``excluded`` (storage keys of parameters and flat buffers)."""
    storages = {}
    for t in tensors:
        key = _device.storage_key(t)
        if key not in excluded:
            storages[key] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _signature(value: object) -> tuple[object, ...]:
    """What decides a stage's saved bytes: its inputs' shapes, dtypes and grad flags,
    and any plain values among them."""
    return tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
        if isinstance(leaf, torch.Tensor)
        else leaf
        if isinstance(leaf, int | float | bool | str | None)
        else type(leaf)
        for leaf in tree_leaves(value)
    )


def _outer_saved_tensor_hooks() -> SavedHooks | None:
    """The ``saved_tensors_hooks`` active around the stage (the user's ``save_on_cpu``,
    say), which :class:`_SavedBytes` must keep applying."""
    return top_saved_tensors_hooks()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages autograd saves for backward inside a stage's
    forward (parameters and gathered parameter buffers excluded); hooks already
    active outside still pack and unpack every tensor."""

    def __init__(self, excluded: set[int]) -> None:
        self.bytes = 0
        self.seen: set[int] = set()
        self.excluded = excluded
        self.outer = _outer_saved_tensor_hooks()
        super().__init__(self.pack, _identity if self.outer is None else self.outer[1])

    def pack(self, t: torch.Tensor) -> object:
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            key = _device.storage_key(t)
            if key not in self.seen and key not in self.excluded:
                self.seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t if self.outer is None else self.outer[0](t)


def counting_only(pack: Callable[[torch.Tensor], object]) -> bool:
    """Whether ``pack`` (a ``saved_tensors_hooks`` pack hook active now) is
    :class:`_SavedBytes`'s with no hooks around it: it counts bytes and keeps each
    tensor as it is, so a layer may keep a tensor for backward itself (counted by
    passing it to ``pack``) without defeating the hooks."""
    owner = getattr(pack, "__self__", None)
    return isinstance(owner, _SavedBytes) and owner.outer is None


class ActivationMemory:
    """The bytes one step keeps for backward on this rank, and their peak."""

    def __init__(self, excluded: Iterable[torch.Tensor]) -> None:
        """``excluded``: parameters and flat parameter buffers (never activations)."""
        self.excluded = {_device.storage_key(t) for t in excluded}
        self.held_bytes = 0
        """Bytes now kept for backward: stage inputs and outputs, and what autograd
        saved inside the stages."""
        self.peak_bytes = 0
        """Peak of ``held_bytes`` during the step."""
        self.saved_inside: dict[tuple[int, int], int] = {}
        """(stage, microbatch) -> bytes autograd saved inside its forward."""
        self.waiting_for_w: dict[tuple[int, int], int] = {}
        """(stage, microbatch) -> bytes its I left for its W: the kept layers' inputs and
        output gradients, or a whole deferred backward's graph."""
        self.signatures: dict[tuple[int, int], tuple[nn.Module, tuple[object, ...]]] = {}
        """(stage, microbatch) -> the stage and the input signature of its forward."""

    def hold(self, value: object) -> None:
        """The tensors of ``value`` are kept for a backward."""
        self._add(tensor_bytes(value))

    def _add(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def drop(self, stage: int, j: int, value: object) -> int:
        """The backward of ``stage`` for microbatch ``j`` ran: ``value`` (what :meth:`hold`
        was given) and what autograd saved inside its forward are gone; their bytes."""
        dropped = tensor_bytes(value) + self.saved_inside.pop((stage, j), 0)
        self.held_bytes -= dropped
        return dropped

    def held_for_weights(self, s: int, j: int, measure: Callable[[], int]) -> int:
        """What the I of stage ``s`` for microbatch ``j`` leaves for its W: ``measure()``,
        once per input signature of the stage's forward (as what autograd saves)."""
        found = self.signatures.pop((s, j), None)
        if found is None:
            return measure()
        stage, key = found
        known = _HELD_FOR_W.setdefault(stage, {})
        if key not in known:
            _remember(known, key, measure())
        return known[key]

    def hold_for_weights(self, stage: int, j: int, nbytes: int) -> None:
        """After the I of ``stage`` for microbatch ``j``: ``nbytes`` stay held until its
        W (:meth:`weights_done`)."""
        self.waiting_for_w[(stage, j)] = nbytes
        self._add(nbytes)

    def weights_done(self, stage: int, j: int) -> None:
        """The W of ``stage`` for microbatch ``j`` ran: what its I left held is gone."""
        self.held_bytes -= self.waiting_for_w.pop((stage, j), 0)

    @contextlib.contextmanager
    def counting(self, stage: nn.Module, s: int, j: int, inputs: object) -> Iterator[None]:
        """Around a training forward of ``stage`` (index ``s``) for microbatch ``j``: what
        autograd saves inside it (measured once per input signature) is held."""
        known = _SAVED_BYTES.setdefault(stage, {})
        key = _signature((inputs, stage.training))
        counter = None if key in known else _SavedBytes(self.excluded)
        with counter or contextlib.nullcontext():
            yield
        if counter is not None:
            _remember(known, key, counter.bytes)
        saved = known[key]
        self.saved_inside[(s, j)] = saved
        self.signatures[(s, j)] = (stage, key)
        self.held_bytes += saved
