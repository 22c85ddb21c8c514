"""Peak bytes of the tensors a block of code creates, counted in one process (CPU).

A dispatch mode sees every tensor an operator returns, forward and backward: each new
storage is counted until it is freed (a weak reference to it expires). Storages that
existed before the block (parameters, optimizer state) are left out, so the peak is
what the block adds; a storage resized in place counts at its current size (ZeRO-3
frees its gathered buffers that way). Storages are told apart by identity, not by
address: a storage resized to 0 gives its memory back while it lives, and the next
allocation may take the same address. Allocator caching and non-tensor memory are
not in it.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TensorPeak"]


class TensorPeak(TorchDispatchMode):
    """``with TensorPeak() as t: ...``; then ``t.peak`` bytes (and ``t.at_peak``: the
    (bytes, operator) of each storage alive at that moment, largest first)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[Any, int, str]] = {}
        self.current = self.peak = 0
        self.at_peak: list[tuple[int, str]] = []
        # storages that held memory before the block, by identity, with a weak reference
        # so that a new storage reusing a freed one's identity is still counted
        self.before: dict[int, Any] = {}
        with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
            warnings.simplefilter("ignore", FutureWarning)
            objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for obj in objects:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                grad = obj.grad if isinstance(obj, torch.nn.Parameter) else None
                for t in (obj, grad):
                    if t is None:
                        continue
                    with contextlib.suppress(RuntimeError, NotImplementedError):  # fake tensors
                        storage = t.untyped_storage()
                        if storage.nbytes():  # an empty one (a freed ZeRO-3 gather) may grow
                            ref = StorageWeakRef(storage)
                            self.before[ref.cdata] = ref

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key, (ref, nbytes, name) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes
                continue
            now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            if now != nbytes:  # freed in place (a ZeRO-3 gather buffer resized to 0)
                self.live[key] = (ref, now, name)
                self.current += now - nbytes
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                key = ref.cdata
                old = self.before.get(key)
                if old is not None and old.expired():
                    del self.before[key]
                    old = None
                if storage.nbytes() and key not in self.live and old is None:
                    self.live[key] = (ref, storage.nbytes(), str(func))
                    self.current += storage.nbytes()
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = sorted(((n, name) for _, n, name in self.live.values()), reverse=True)
        return out
