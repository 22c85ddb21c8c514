"""Context-parallel attention as differentiable operators inside captured stage graphs.

Each rank of a context-parallel (CP) group holds some of every sequence's tokens (the
head-tail layout of :mod:`mpar._cp_context`); attention needs every key of the
sequence. As with tensor parallelism (:mod:`mpar.comm._tp_ops`), the operators are
``torch.library`` custom operators with registered backward formulas, so a captured
stage graph keeps each as one node:

=============================  ===========================================  ===========================
operator                       forward                                      backward
=============================  ===========================================  ===========================
``cp_ring_attention``          this rank's queries on every rank's keys:    the same ring again; dK/dV
                               K/V passed around the CP group, blocks       travel with K/V and come
                               merged by online softmax                     home after ``cp`` steps
``cp_to_heads``                [B, H, S/cp, D] sequence-sharded ->          ``cp_to_sequence``
                               [B, H/cp, S, D] head-sharded (all-to-all)
``cp_to_sequence``             the inverse (all-to-all)                     ``cp_to_heads``
``cp_local_attention``         attention on the whole sequence in natural   its own blocks, no
                               order, with the microbatch's masks           communication
``cp_shift_labels``            a causal LM's next-token targets of this     none (integers)
                               rank's tokens, from the whole sequence
``cp_position_ids``            this rank's tokens' global ``position_ids``  none (integers)
=============================  ===========================================  ===========================

The ring posts each step's send (to the next CP rank) and receive (from the previous)
together as one ``batch_isend_irecv``, the next step's K/V while this step computes;
every CP rank runs the same steps in the same order, so each pair of ranks agrees on
the order of its messages (NCCL's rules; tags carry no meaning). The all-to-all
variant (DeepSpeed Ulysses) trades the sequence split for a head split with
``all_to_all_single`` and runs the attention of its heads on the whole sequence.

Masks come from the current :class:`~mpar._cp_context.CPContext` (the runtime makes
a microbatch's context current around its computations), never from the model's own
mask tensors, which describe only the rank's own tokens. Without a current context
(one process, the profiler) every operator computes plain attention on what it is
given (``cp_to_heads`` and ``cp_to_sequence`` are the identity).

Operators name their group by a key registered with :func:`register_cp_group`;
:func:`clear_cp_groups` (run by ``mpar.shutdown``) forgets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mpar import _device
from mpar._attention_blocks import block_backward, block_forward, merge_into
from mpar._cp_context import (
    CPContext,
    Piece,
    TokenLayout,
    current,
    natural_pieces,
    reset_current,
    unmasked_block,
    using,
)
from mpar.comm import _process_state
from mpar.comm._nccl_rules import NcclRules
from mpar.comm._progress import Waiting
from mpar.comm._types import ProcessGroup

__all__ = [
    "CP_GROUP",
    "clear_cp_groups",
    "cp_groups_cleared",
    "cp_local_attention",
    "cp_position_ids",
    "cp_ring_attention",
    "cp_shift_labels",
    "cp_to_heads",
    "cp_to_sequence",
    "register_cp_group",
]


@dataclass(frozen=True)
class _CPGroup:
    group: ProcessGroup | None
    size: int
    rank: int
    ranks: tuple[int, ...]
    """Global rank of each CP rank (the peers of ``batch_isend_irecv``)."""
    rules: NcclRules | None = None
    """The NCCL-rules test transport (config key ``nccl_rules``): the ring's exchanges
    are posted through it, one group per step, instead of ``batch_isend_irecv``."""


_GROUPS: dict[str, _CPGroup] = {}

CP_GROUP = "cp"
"""The key of the grid's CP group (registered by ``mpar.init``)."""


def register_cp_group(
    key: str,
    group: ProcessGroup | None,
    size: int,
    rank: int,
    ranks: list[int],
    rules: NcclRules | None = None,
) -> str:
    """Make ``group`` (this rank at ``rank`` of ``size``; ``ranks`` its members' global
    ranks) known to the operators as ``key``; ``rules``: the NCCL-rules transport the
    ring posts through (peers by global rank), or None."""
    _GROUPS[key] = _CPGroup(group, size, rank, tuple(ranks), rules)
    return key


def clear_cp_groups() -> None:
    _GROUPS.clear()


def cp_groups_cleared() -> bool:
    return not _GROUPS


def _group(key: str) -> _CPGroup:
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(
            f"context-parallel group {key!r} is not registered in this process (a stage built "
            "for one mpar.init used after mpar.shutdown?)"
        ) from None


def _active(key: str) -> tuple[_CPGroup, CPContext] | None:
    """The group and the current context when the operators communicate, else None."""
    context = current()
    if context is None:
        return None
    g = _group(key)
    return (g, context) if g.size > 1 else None


# -- the ring ---------------------------------------------------------------------------


class _Exchange:
    """One ring step's transfer: ``send`` (tensors) to the next CP rank and tensors like
    them from the previous, posted together as one group (:meth:`wait` returns the
    received ones)."""

    def __init__(self, send: tuple[torch.Tensor, ...], g: _CPGroup) -> None:
        self.received = tuple(
            torch.empty_like(t, memory_format=torch.contiguous_format) for t in send
        )
        self.group = g.group
        after, before = g.ranks[(g.rank + 1) % g.size], g.ranks[(g.rank - 1) % g.size]
        self.works: list[Any]
        if g.rules is not None:  # NCCL's rules enforced: one group per step, FIFO per pair
            posted = [(True, after, t.contiguous(), "ring send") for t in send]
            posted += [(False, before, t, "ring receive") for t in self.received]
            self.works = [g.rules.post(posted)]
            return
        ops = [dist.P2POp(dist.isend, t.contiguous(), after, g.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, before, g.group) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        with Waiting(("collective", "context-parallel ring exchange", self.group)):
            for work in self.works:
                work.wait()
        return self.received


Pairs = list[tuple[Piece, Piece, Any]]


def _pairs(
    context: CPContext | None,
    queries: list[Piece],
    keys: list[Piece],
    causal: bool,
    window: int,
) -> Pairs:
    """(query piece, key piece, mask) of every block that sees something."""
    out = []
    for q in queries:
        for k in keys:
            mask = (
                context.block(q, k, causal, window)
                if context is not None
                else unmasked_block(q, k, causal, window)
            )
            if mask is not None:
                out.append((q, k, mask))
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: Pairs,
    scale: float,
    acc: tuple[torch.Tensor, torch.Tensor],
    *,
    fresh: bool = False,
) -> None:
    """Merge the blocks ``pairs`` of ``q`` on ``k``, ``v`` into ``acc`` (out, lse);
    ``fresh``: ``acc`` holds nothing yet (rows no block sees must then be set by the
    caller: :func:`_empty_acc` gives zeros and -inf)."""
    out, lse = acc
    seen: set[int] = set()
    fused = _device.has_cpu_flash_attention(q)
    for qp, kp, mask in pairs:
        rows, cols = qp.local, kp.local
        o, l_ = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask, scale, fused=fused)
        if qp.offset in seen or not fresh:
            merge_into(out[:, :, rows], lse[:, :, rows], o, l_)
        else:  # the first block of these queries: nothing to merge with yet
            out[:, :, rows] = o
            lse[:, :, rows] = l_
            seen.add(qp.offset)


def _empty_acc(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, _ = q.shape
    out = torch.zeros((b, h, s, v.shape[-1]), dtype=torch.float32, device=q.device)
    return out, torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device)


def _local_pieces(q: torch.Tensor) -> list[Piece]:
    return natural_pieces(q.shape[2], masked=False)


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    group: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _empty_acc(q, v)
    active = _active(group)
    if active is None:
        pieces = _local_pieces(q)
        pairs = _pairs(current(), pieces, pieces, causal, window)
        _attend(q, k, v, pairs, scale, acc, fresh=True)
        return acc[0].to(q.dtype), acc[1]
    g, context = active
    layout = context.layout
    queries = layout.pieces(g.rank)
    kv: tuple[torch.Tensor, ...] = (k.detach(), v.detach())
    for step in range(g.size):
        pending = _Exchange(kv, g) if step < g.size - 1 else None
        keys = layout.pieces((g.rank - step) % g.size)
        pairs = _pairs(context, queries, keys, causal, window)
        _attend(q, kv[0], kv[1], pairs, scale, acc, fresh=step == 0)
        if pending is not None:
            kv = pending.wait()
    return acc[0].to(q.dtype), acc[1]


@torch.library.custom_op("mpar::cp_ring_attention", mutates_args=())
def cp_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    group: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries ``q`` [B, H, S/cp, D] on the whole sequence's
    keys (``k``, ``v`` [B, Hkv, S/cp, D] on each rank, passed around the CP group):
    ``(out, lse)``. ``window`` > 0: a sliding window of that many keys."""
    return _ring_forward(q, k, v, scale, causal, window, group)


@cp_ring_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    group: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, _ = q.shape
    return q.new_empty((b, h, s, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


def _setup_attention(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(rest)
    ctx.context = current()


def _block_grads(
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    kv: tuple[torch.Tensor, torch.Tensor],
    pairs: Pairs,
    scale: float,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Add the gradients of the blocks ``pairs`` to ``grads`` (dq, dk, dv)."""
    q, _, _, out, lse = saved
    dq, dk, dv = grads
    fused = _device.has_cpu_flash_attention(q)
    for qp, kp, mask in pairs:
        rows, cols = qp.local, kp.local
        a, b, c = block_backward(
            dout[:, :, rows],
            q[:, :, rows],
            kv[0][:, :, cols],
            kv[1][:, :, cols],
            out[:, :, rows],
            lse[:, :, rows],
            mask,
            scale,
            fused=fused,
        )
        dq[:, :, rows] += a
        dk[:, :, cols] += b
        dv[:, :, cols] += c


def _zeros(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tensors)


def _ring_backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    q, k, v = saved[:3]
    scale, causal, window, group = ctx.args
    context: CPContext | None = ctx.context
    dq, dk, dv = _zeros(q, k, v)
    g = _group(group) if context is not None else None
    if g is None or g.size == 1:
        pieces = _local_pieces(q)
        pairs = _pairs(context, pieces, pieces, causal, window)
        _block_grads(dout, saved, (k, v), pairs, scale, (dq, dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
    assert context is not None
    layout = context.layout
    queries = layout.pieces(g.rank)
    kv: tuple[torch.Tensor, ...] = (k, v)
    dkv: tuple[torch.Tensor, ...] = (dk, dv)
    for step in range(g.size):
        pending = _Exchange(kv, g) if step < g.size - 1 else None
        keys = layout.pieces((g.rank - step) % g.size)
        pairs = _pairs(context, queries, keys, causal, window)
        _block_grads(dout, saved, (kv[0], kv[1]), pairs, scale, (dq, dkv[0], dkv[1]))
        dkv = _Exchange(dkv, g).wait()  # the accumulated dK/dV travel on with their K/V
        if pending is not None:
            kv = pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


cp_ring_attention.register_autograd(_ring_backward, setup_context=_setup_attention)


# -- all-to-all (Ulysses) -----------------------------------------------------------------


def _all_to_all(x: torch.Tensor, g: _CPGroup) -> torch.Tensor:
    """Piece ``i`` of dim 0 of ``x`` to CP rank ``i``; the result's piece ``i`` is rank
    ``i``'s."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with Waiting(("collective", "all_to_all", g.group)):
        dist.all_to_all_single(out, x, group=g.group)
    return out


def _runs(layout: TokenLayout) -> list[tuple[int, int, int, int]]:
    """``(rank, local start, global start, length)`` of every contiguous run of tokens of
    ``layout`` (each rank's runs in local order)."""
    out = []
    for rank in range(layout.size):
        local = 0
        for start, length in layout.runs(rank):
            out.append((rank, local, start, length))
            local += length
    return out


def _heads(x: torch.Tensor, g: _CPGroup, layout: TokenLayout) -> torch.Tensor:
    """[B, H, S/cp, D] this rank's tokens -> [B, H/cp, S, D] natural order. Two copies:
    into the send buffer (head group first) and, run by run, from the received pieces
    into natural order (any strides of ``x``)."""
    b, h, s, d = x.shape
    n = g.size
    got = _all_to_all(x.reshape(b, n, h // n, s, d).movedim(1, 0), g)  # [n (source), ...]
    whole = x.new_empty((b, h // n, n * s, d))
    for rank, local, start, length in _runs(layout):
        whole[:, :, start : start + length] = got[rank, :, :, local : local + length]
    return whole


def _sequence(x: torch.Tensor, g: _CPGroup, layout: TokenLayout) -> torch.Tensor:
    """The inverse of :func:`_heads`, also in two copies: run by run into the send buffer
    [cp (destination), B, H/cp, S/cp, D], and from the received pieces (head groups)."""
    b, hg, length, d = x.shape
    n = g.size
    send = x.new_empty((n, b, hg, length // n, d))
    for rank, local, start, size in _runs(layout):
        send[rank, :, :, local : local + size] = x[:, :, start : start + size]
    got = _all_to_all(send, g)  # [cp (head group), B, H/cp, S/cp, D]
    return got.movedim(0, 1).reshape(b, n * hg, length // n, d)


@torch.library.custom_op("mpar::cp_to_heads", mutates_args=())
def cp_to_heads(x: torch.Tensor, group: str) -> torch.Tensor:
    """[B, H, S/cp, D] (this rank's tokens, every head) -> [B, H/cp, S, D] (every token
    in natural order, this rank's heads); backward: :func:`cp_to_sequence`."""
    active = _active(group)
    if active is None:
        return x.clone()
    g, context = active
    return _heads(x.detach(), g, context.layout)


@torch.library.custom_op("mpar::cp_to_sequence", mutates_args=())
def cp_to_sequence(x: torch.Tensor, group: str) -> torch.Tensor:
    """The inverse of :func:`cp_to_heads`; backward: :func:`cp_to_heads`."""
    active = _active(group)
    if active is None:
        return x.clone()
    g, context = active
    return _sequence(x.detach(), g, context.layout)


def _size(group: str) -> int:
    """The CP degree the shapes of a captured graph assume (the operators communicate
    in every step of the runtime, which makes a context current)."""
    return _group(group).size


@cp_to_heads.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    b, h, s, d = x.shape
    n = _size(group)
    return x.new_empty((b, h // n, s * n, d))


@cp_to_sequence.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    b, h, s, d = x.shape
    n = _size(group)
    return x.new_empty((b, h * n, s // n, d))


def _setup_swap(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group = inputs[1]
    ctx.context = current()


def _swap_back(ctx: Any, grad: torch.Tensor, to_heads: bool) -> tuple[Any, ...]:
    context: CPContext | None = ctx.context
    g = _group(ctx.group)
    if context is None or g.size == 1:
        return grad.clone(), None
    swap = _heads if to_heads else _sequence
    return swap(grad, g, context.layout), None


cp_to_heads.register_autograd(
    lambda ctx, grad: _swap_back(ctx, grad, to_heads=False), setup_context=_setup_swap
)
cp_to_sequence.register_autograd(
    lambda ctx, grad: _swap_back(ctx, grad, to_heads=True), setup_context=_setup_swap
)


def _natural_pairs(length: int, causal: bool, window: int) -> Pairs:
    context = current()
    masked = context is not None and (context.masked or window > 0)
    pieces = natural_pieces(length, masked)
    return _pairs(context, pieces, pieces, causal, window)


@torch.library.custom_op("mpar::cp_local_attention", mutates_args=())
def cp_local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B, H, S, D] on ``k``, ``v`` [B, Hkv, S, D], the whole sequence
    in natural order (between ``cp_to_heads`` and ``cp_to_sequence``), masked as the
    current context says: ``(out, lse)``. One block (no mask beyond causality, or a
    short sequence) is the kernel's own result, with nothing to merge."""
    pairs = _natural_pairs(q.shape[2], causal, window)
    if len(pairs) == 1:
        fused = _device.has_cpu_flash_attention(q)
        out, lse = block_forward(q, k, v, pairs[0][2], scale, fused=fused)
        return out.to(q.dtype), lse
    acc = _empty_acc(q, v)
    _attend(q, k, v, pairs, scale, acc, fresh=True)
    return acc[0].to(q.dtype), acc[1]


@cp_local_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, _ = q.shape
    return q.new_empty((b, h, s, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


def _local_backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    q, k, v = saved[:3]
    scale, causal, window = ctx.args
    with using(ctx.context):
        pairs = _natural_pairs(q.shape[2], causal, window)
    if len(pairs) == 1:  # one block: its gradients whole, nothing to add up
        fused = _device.has_cpu_flash_attention(q)
        out, lse = saved[3:]
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, pairs[0][2], scale, fused=fused)
    else:
        dq, dk, dv = _zeros(q, k, v)
        _block_grads(dout, saved, (k, v), pairs, scale, (dq, dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


cp_local_attention.register_autograd(_local_backward, setup_context=_setup_attention)


# -- labels -------------------------------------------------------------------------------


def _gathered(x: torch.Tensor, g: _CPGroup, layout: TokenLayout) -> torch.Tensor:
    """The whole sequence [B, L] from every CP rank's tokens [B, L / cp]."""
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(g.size)]
    with Waiting(("collective", "all_gather", g.group)):
        dist.all_gather(pieces, x, group=g.group)
    return layout.unshard(pieces, dim=1)


@torch.library.custom_op("mpar::cp_shift_labels", mutates_args=())
def cp_shift_labels(
    labels: torch.Tensor, ignore_index: int, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's targets for this rank's tokens [B, S/cp]: each token's *next* label in
    the whole sequence (``ignore_index`` after the last), and the count of targets that
    are not ``ignore_index`` in the whole sequence. Without a current context: the same
    of ``labels`` alone (Hugging Face's own shift)."""
    active = _active(group)
    whole = labels if active is None else _gathered(labels, active[0], active[1].layout)
    pad = torch.full_like(whole[:, :1], ignore_index)
    shifted = torch.cat([whole[:, 1:], pad], dim=1)
    count = (shifted != ignore_index).sum()
    if active is None:
        return shifted, count
    g, context = active
    return context.layout.shard(shifted, g.rank), count


@cp_shift_labels.register_fake
def _(labels: torch.Tensor, ignore_index: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(labels), labels.new_empty(())


# -- positions ----------------------------------------------------------------------------


@torch.library.custom_op("mpar::cp_position_ids", mutates_args=())
def cp_position_ids(like: torch.Tensor) -> torch.Tensor:
    """The global ``position_ids`` [B, S/cp] of this rank's tokens, for a model that
    computes its positions itself; ``like`` [B, S/cp, ...] gives the batch, the device
    and, without a current context, the length (then ``arange``)."""
    b, s = like.shape[:2]
    context = current()
    if context is None:
        return torch.arange(s, device=like.device).expand(b, s).clone()
    return context.local_positions().to(like.device).expand(b, s).clone()


@cp_position_ids.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(tuple(like.shape[:2]), dtype=torch.long)


_process_state.register("mpar._cp_context._CURRENT", reset_current, lambda: current() is None)
