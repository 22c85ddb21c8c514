"""Measuring where a model attends, for context parallelism in the plan (one forward).

``measure_attention`` runs the whole model once without gradients (on fake tensors
when the model is on the meta device or was profiled in meta mode, as
``mpar.profile`` does) and records each ``scaled_dot_product_attention`` call with the
unit it runs in: its tokens (samples x sequence), head size, query heads and key/value
heads. Hugging Face models attend through it under their ``"sdpa"`` implementation;
where they repeat the key/value heads for grouped-query attention first, the repeat
(the attention module's ``num_key_value_groups``) is divided out, as the CP operators
move the unrepeated ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mpar.partition._cp_share import AttentionCall, CPAttention
from mpar.partition._tp_measure import _running

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from mpar.profile import UnitProfile

__all__ = ["measure_attention"]


class _Attention(TorchFunctionMode):
    """Records each ``scaled_dot_product_attention`` call with the running unit."""

    def __init__(self) -> None:
        super().__init__()
        self.unit: str | None = None
        self.groups: list[int] = []
        self.calls: dict[str, list[AttentionCall]] = {}
        self.sequence = 0

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and self.unit is not None:
            self._record(args, kwargs)
        return func(*args, **kwargs)

    def _record(self, args: Sequence[object], kwargs: Mapping[str, object]) -> None:
        q, k = (args[i] if len(args) > i else kwargs[n] for i, n in ((0, "query"), (1, "key")))
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        kv_heads = int(k.shape[-3])
        if not kwargs.get("enable_gqa") and self.groups and kv_heads == q.shape[-3]:
            kv_heads = max(kv_heads // self.groups[-1], 1)  # repeated for the call
        tokens = int(q.shape[-2]) * (int(q.shape[0]) if q.dim() == 4 else 1)
        call = AttentionCall(tokens, int(q.shape[-1]), int(q.shape[-3]), kv_heads)
        assert self.unit is not None
        self.calls.setdefault(self.unit, []).append(call)
        self.sequence = self.sequence or int(q.shape[-2])


@contextmanager
def _hooked(module: nn.Module, units: Sequence[str], rec: _Attention) -> Iterator[None]:
    handles: list[RemovableHandle] = []

    def enter(name: str) -> None:
        rec.unit = name

    def leave() -> None:
        rec.unit = None

    def pop() -> None:  # a forward hook's return value would replace the output
        rec.groups.pop()

    for name in units:
        sub = module.get_submodule(name)
        handles.append(sub.register_forward_pre_hook(lambda *_a, n=name: enter(n)))
        handles.append(sub.register_forward_hook(lambda *_a: leave()))
    for sub in module.modules():
        groups = getattr(sub, "num_key_value_groups", None)
        if isinstance(groups, int) and groups > 1:
            handles.append(sub.register_forward_pre_hook(lambda *_a, g=groups: rec.groups.append(g)))  # fmt: skip
            handles.append(sub.register_forward_hook(lambda *_a: pop()))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def measure_attention(
    module: nn.Module,
    units: Sequence[UnitProfile],
    args: Sequence[object],
    kwargs: Mapping[str, object] | None = None,
    *,
    fake: bool = False,
) -> CPAttention:
    """Per unit of a profile: the attention calls of one forward at the example inputs
    (see the module docs). ``fake``: run on fake tensors even for a real model."""
    rec = _Attention()
    names = [u.name for u in units]
    running = _running(module, tuple(args), dict(kwargs or {}), fake)
    with running as (a, kw, _exclude), _hooked(module, names, rec), torch.no_grad(), rec:
        module(*a, **kw)
    calls = {name: tuple(found) for name, found in rec.calls.items()}
    return CPAttention(calls, rec.sequence)
