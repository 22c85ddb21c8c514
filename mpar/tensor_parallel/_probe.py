"""Is a module's head count known, or is it safe to infer it from the tensors? Checked
when the model is wrapped, on the meta device.

Splitting attention by columns hands each TP rank ``heads / tp`` whole heads, and the
module's reshapes must follow: either they read the head count from an attribute mpar
divides (:data:`~mpar.tensor_parallel._apply.HEAD_ATTRS`, a Hugging Face config's
head counts), or they take it from the tensor (``view(b, t, -1, head_dim)``). A module
that keeps it under another name (``self.nh``) and reshapes with it
(``view(b, t, self.nh, -1)``) would cut every head in ``tp`` pieces instead: it runs,
and trains a different model.

So for each module holding a colwise-split module whose head count mpar does not know,
:func:`check_inferred_heads` runs its forward twice on a probe input on the meta
device — whole, and as one TP rank sees it (the split modules' weights and outputs in
their local shapes) — and compares every contraction outside the split modules
(``mm``/``bmm`` inner sizes, attention's head size, normalised sizes): splitting by
heads never changes one. A difference, or a split forward that fails, is refused with
the fix. Where no probe input can be made (the forward needs more than one tensor),
an integer attribute that could count heads is refused; without one, nothing in the
module can hold a head count, and the heads come from the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpar.tensor_parallel._tp_plan import Style, TPPlanError

__all__ = ["check_inferred_heads"]

PER_HEAD_ATTRS = frozenset(
    {"head_dim", "head_size", "d_head", "d_k", "d_kv", "attention_head_size", "key_value_proj_dim"}
)
"""Integer attributes that size one head: a split by heads keeps them."""

_BATCH, _SEQ = 2, 7
"""Probe input sizes, chosen to differ from any feature size."""


def _contraction(func: Any, args: tuple[Any, ...]) -> int | None:
    """The size an op reduces over, for the ops a head split must leave alone."""
    name = func.overloadpacket.__name__
    if name in ("mm", "bmm"):
        return int(args[0].shape[-1])
    if name in ("addmm", "baddbmm", "addbmm"):
        return int(args[1].shape[-1])
    if "scaled_dot_product" in name:
        return int(args[0].shape[-1])
    if name == "native_layer_norm":
        return int(torch.Size(args[1]).numel())
    if name in ("mean", "sum", "var", "amax", "std") and len(args) > 1:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if all(isinstance(d, int) for d in dims):
            return int(torch.Size([args[0].shape[d] for d in dims]).numel())
    return None


class _Contractions(TorchDispatchMode):
    """Records ``(op, size)`` for every op :func:`_contraction` knows."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        size = _contraction(func, args)
        if size is not None:
            self.seen.append((func.overloadpacket.__name__, size))
        return func(*args, **(kwargs or {}))


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a module the plan may split."""
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    if isinstance(module, nn.Linear):
        return int(weight.shape[1]), int(weight.shape[0])
    return int(weight.shape[0]), int(weight.shape[1])  # transformers' Conv1D: (in, out)


def _stub(module: nn.Module, style: Style, tp: int, split: bool, name: str) -> Callable[..., Any]:
    """A forward giving the module's output shape, whole or as one TP rank's."""
    fan_in, fan_out = _sizes(module)
    embedding = isinstance(module, nn.Embedding)
    rowwise_in = style.kind == "rowwise" and split and not style.split_input
    want_in = fan_in // tp if rowwise_in else fan_in
    local_out = split and style.kind == "colwise" and not style.gather_output

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if embedding:
            return torch.empty((*x.shape, fan_out // tp if local_out else fan_out), device=x.device)
        if x.shape[-1] != want_in:
            raise TPPlanError(
                f"{name} receives {x.shape[-1]} input features where it takes {want_in}"
            )
        return x.new_empty((*x.shape[:-1], fan_out // tp if local_out else fan_out))

    return forward


@contextmanager
def _stubbed(stubs: Mapping[nn.Module, Callable[..., Any]]) -> Iterator[None]:
    saved = {m: m.__dict__.get("forward") for m in stubs}
    try:
        for m, stub in stubs.items():
            m.forward = stub
        yield
    finally:
        for m, old in saved.items():
            if old is None:
                del m.forward
            else:
                m.forward = old


def _run(
    parent: nn.Module,
    inputs: torch.Tensor,
    planned: Mapping[str, tuple[nn.Module, Style]],
    shards: Mapping[str, Any],
    tp: int,
    split: bool,
) -> list[tuple[str, int]]:
    """The contractions of ``parent``'s forward on meta tensors (whole, or one TP rank's)."""
    tensors: dict[str, torch.Tensor] = {}
    for key, t in [*parent.named_parameters(), *parent.named_buffers()]:
        shard = shards.get(key) if split else None
        shape = shard.local_shape(t.shape) if shard is not None else t.shape
        tensors[key] = torch.empty(shape, dtype=t.dtype, device="meta")
    stubs = {m: _stub(m, style, tp, split, n) for n, (m, style) in planned.items()}
    recorder = _Contractions()
    with _stubbed(stubs), torch.no_grad(), recorder:
        torch.func.functional_call(parent, tensors, (inputs,))
    return recorder.seen


def _probe_input(planned: Mapping[str, tuple[nn.Module, Style]]) -> torch.Tensor:
    module = next(iter(planned.values()))[0]
    if isinstance(module, nn.Embedding):
        return torch.zeros(_BATCH, _SEQ, dtype=torch.long, device="meta")
    fan_in = _sizes(module)[0]
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    dtype = weight.dtype
    return torch.empty(_BATCH, _SEQ, fan_in, dtype=dtype, device="meta")


def _suspects(parent: nn.Module, planned: Mapping[str, tuple[nn.Module, Style]]) -> dict[str, int]:
    """Integer attributes of ``parent`` that could count heads: more than one, fewer than
    the output features of a colwise-split module, and dividing them."""
    features = [
        _sizes(m)[1] // style.packs for m, style in planned.values() if style.kind == "colwise"
    ]
    return {
        k: v
        for k, v in vars(parent).items()
        if type(v) is int
        and not k.startswith("_")
        and k not in PER_HEAD_ATTRS
        and any(1 < v < f and f % v == 0 for f in features)
    }


def _fix(label: str, suspects: Mapping[str, int], head_attrs: tuple[str, ...]) -> str:
    held = f" (it holds {dict(suspects)})" if suspects else ""
    return (
        f"mpar cannot establish the head count of {label}{held}, so it cannot split it "
        f"safely. Fix: keep the head count in an attribute mpar divides by the TP degree "
        f"({', '.join(head_attrs[:4])}, ...), or reshape with -1 for the heads and a fixed "
        "head size (view(b, t, -1, self.head_dim)); or leave its modules out of tp_plan"
    )


def check_inferred_heads(
    parent: nn.Module,
    label: str,
    planned: Mapping[str, tuple[nn.Module, Style]],
    shards: Mapping[str, Any],
    tp: int,
    head_attrs: tuple[str, ...],
) -> None:
    """Raise :class:`TPPlanError` unless splitting ``parent`` (``label`` names it) by the
    plan keeps every per-head computation (see the module docstring). ``planned``: its
    planned modules by name relative to it; ``shards``: its parameters' splits, by name
    relative to it."""
    inputs = _probe_input(planned)
    try:
        whole = _run(parent, inputs, planned, shards, tp, split=False)
    except Exception:
        suspects = _suspects(parent, planned)
        if suspects:
            raise TPPlanError(
                _fix(label, suspects, head_attrs) + " (its forward could not run on a "
                f"probe input of shape {tuple(inputs.shape)} to check)"
            ) from None
        return
    try:
        split = _run(parent, inputs, planned, shards, tp, split=True)
    except Exception as exc:
        raise TPPlanError(
            f"{label} fails when split {tp} ways ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). "
            + _fix(label, _suspects(parent, planned), head_attrs)
        ) from None
    for (op, want), (_, got) in zip(whole, split):
        if want != got:
            raise TPPlanError(
                f"split {tp} ways, {label} computes {op} over {got} elements where the whole "
                f"module uses {want}: its heads would be cut in pieces, not shared out. "
                + _fix(label, _suspects(parent, planned), head_attrs)
            )
    if len(whole) != len(split):
        raise TPPlanError(
            f"split {tp} ways, {label} runs other operations than whole. "
            + _fix(label, _suspects(parent, planned), head_attrs)
        )
