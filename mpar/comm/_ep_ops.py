"""Expert-parallel token dispatch as differentiable operators inside captured stage graphs.

A mixture-of-experts layer under expert parallelism keeps ``E / ep`` of its ``E``
experts on each rank of an ep group. Its tokens go to the ranks of their experts and
come back, with no capacity limit (dropless): the routing decides how many rows each
rank receives, so the sizes are exchanged first and the rows travel in one
``all_to_all_single`` with uneven splits. Two ``torch.library`` operators do it, each
one node of a graph captured with ``torch.export`` (as the TP operators of
:mod:`mpar.comm._tp_ops`), with registered backward formulas:

==================  ===============================================  =====================
operator            forward                                          backward
==================  ===============================================  =====================
``ep_dispatch``     the ``T x k`` (token, expert) pairs sorted by    the rows' gradients
                    expert; per-expert counts exchanged; each        sent back, summed per
                    pair's row and weight sent to its expert's       token (and weight)
                    rank: ``R`` rows, their local expert index,
                    weight, the sort order and the counts
``ep_combine``      the experts' ``R`` output rows sent back, put    each pair's gradient
                    in pair order, summed over a token's ``k``       (its token's) sent to
                    pairs                                            the expert's rank
``batch_sum``       sum over the group (router statistics)           sum over the group
==================  ===============================================  =====================

Between the two, the experts run as ordinary graph code on the ``R`` rows (a size
the capture sees as data-dependent). Rows travel as bytes: a row's hidden values
followed by its routing weight, one message for both whatever their dtypes.

Bytes on the wire per MoE layer and microbatch, for one rank that routes ``S = T k``
pairs (``T`` tokens, ``k`` experts each) of hidden size ``H``, ``b`` bytes per hidden
element and ``w`` per routing weight, with a fraction ``f`` of them to experts on other
ranks (``(ep - 1) / ep`` for uniform routing): forward ``S f (H b + w)`` (dispatch) +
``S' f' H b`` (combine: the rows this rank received back to their owners), and the
same again in the backward; plus ``8 E`` bytes of counts per dispatch. :data:`TRAFFIC`
counts what was sent, so a test or benchmark can hold it to that formula.

Operators name their group by a key registered with :func:`register_ep_group`
(``mpar.init`` registers the ep group as :data:`EP_GROUP` and the data-parallel group
as :data:`BATCH_GROUP`); :func:`clear_ep_groups` (``mpar.shutdown``) forgets them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mpar.comm._progress import Waiting
from mpar.comm._types import ProcessGroup

__all__ = [
    "BATCH_GROUP",
    "EP_GROUP",
    "TRAFFIC",
    "Traffic",
    "batch_sum",
    "clear_ep_groups",
    "ep_combine",
    "ep_dispatch",
    "ep_groups_cleared",
    "register_ep_group",
]

EP_GROUP = "ep"
"""The key of the grid's ep group (registered by ``mpar.init``)."""
BATCH_GROUP = "batch"
"""The key of the ranks whose microbatches one process would see as one batch: the
data-parallel group (router statistics are summed over it)."""


@dataclass(frozen=True)
class _EPGroup:
    group: ProcessGroup | None
    size: int
    rank: int


_GROUPS: dict[str, _EPGroup] = {}


def register_ep_group(key: str, group: ProcessGroup | None, size: int, rank: int) -> str:
    """Make ``group`` (this rank at ``rank`` of ``size``) known to the operators as ``key``."""
    _GROUPS[key] = _EPGroup(group, size, rank)
    return key


def clear_ep_groups() -> None:
    _GROUPS.clear()


def ep_groups_cleared() -> bool:
    return not _GROUPS


def _group(key: str) -> _EPGroup:
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(
            f"expert-parallel group {key!r} is not registered in this process (a stage built "
            "for one mpar.init used after mpar.shutdown?)"
        ) from None


@dataclass
class Traffic:
    """What the dispatch all-to-alls of this process moved since :meth:`reset`."""

    messages: int = 0
    """All-to-alls of rows (dispatch, combine and their backward formulas)."""
    bytes_sent: int = 0
    """Bytes of rows sent to other ranks (a rank's rows to itself stay local)."""
    count_bytes: int = 0
    """Bytes of per-expert counts sent to other ranks (exchanged before each dispatch)."""
    pairs_routed: int = 0
    """(token, expert) pairs this rank dispatched."""
    pairs_received: int = 0
    """Pairs that reached this rank's experts; summed over an ep group it equals the
    pairs routed: nothing is dropped."""

    def reset(self) -> None:
        self.messages = self.bytes_sent = self.count_bytes = 0
        self.pairs_routed = self.pairs_received = 0

    def is_fresh(self) -> bool:
        """Nothing counted since :meth:`reset` (or import)."""
        return self == Traffic()


TRAFFIC = Traffic()
"""This process's dispatch traffic (reset it with ``TRAFFIC.reset()``)."""


# ------------------------------------------------------------------ communication
def _all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], g: _EPGroup) -> torch.Tensor:
    """``rows`` (split by ``send`` over the group, in rank order) exchanged: the rows every
    rank sent to this one, ``recv[s]`` from rank ``s``, in rank order."""
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    if g.size == 1:
        return out.copy_(rows)
    with Waiting(("collective", "all_to_all (expert dispatch)", g.group)):
        dist.all_to_all_single(out, rows, recv, send, group=g.group)
    row_bytes = rows[0].numel() * rows.element_size() if rows.dim() > 1 else rows.element_size()
    TRAFFIC.messages += 1
    TRAFFIC.bytes_sent += (sum(send) - send[g.rank]) * row_bytes
    return out


def _exchange_counts(hist: torch.Tensor, g: _EPGroup) -> torch.Tensor:
    """``[2, ep, E / ep]``: what this rank sends to each rank's experts (``[0]``) and what
    it receives from each rank for its own experts (``[1]``)."""
    mine = hist.view(g.size, -1)
    theirs = torch.empty_like(mine)
    if g.size == 1:
        theirs.copy_(mine)
    else:
        with Waiting(("collective", "all_to_all (expert counts)", g.group)):
            dist.all_to_all_single(theirs, mine, group=g.group)
        TRAFFIC.count_bytes += (g.size - 1) * mine[0].numel() * mine.element_size()
    return torch.stack([mine, theirs])


def _splits(counts: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows sent to each rank and rows received from each rank."""
    per_rank = counts.sum(dim=2).tolist()
    return [int(n) for n in per_rank[0]], [int(n) for n in per_rank[1]]


def _pack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` with their weight appended, as bytes."""
    return torch.cat(
        [x.contiguous().view(torch.uint8), w.reshape(-1, 1).contiguous().view(torch.uint8)], 1
    )


def _unpack(
    rows: torch.Tensor, width: int, dtype: torch.dtype, w_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    cut = width * dtype.itemsize
    x = rows[:, :cut].contiguous().view(dtype)
    w = rows[:, cut:].contiguous().view(w_dtype).reshape(-1)
    return x, w


# ------------------------------------------------------------------ the operators
def _dispatch(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int, key: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _group(key)
    k = index.shape[-1]
    pairs = index.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    hist = torch.bincount(pairs, minlength=num_experts)
    counts = _exchange_counts(hist, g)
    send, recv = _splits(counts)
    rows = _pack(x[order // k], weights.reshape(-1)[order])
    got = _all_to_all(rows, send, recv, g)
    recv_x, recv_w = _unpack(got, x.shape[-1], x.dtype, weights.dtype)
    local = num_experts // g.size
    experts = torch.arange(local, device=x.device).repeat(g.size)
    recv_ids = torch.repeat_interleave(experts, counts[1].reshape(-1))
    TRAFFIC.pairs_routed += pairs.numel()
    TRAFFIC.pairs_received += recv_ids.numel()
    return recv_x, recv_ids, recv_w, order, counts


@torch.library.custom_op("mpar::ep_dispatch", mutates_args=())
def ep_dispatch(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int, group: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send each of the ``[T, k]`` (token, expert) pairs of ``x [T, H]`` (experts ``index``,
    routing ``weights``) to the rank holding its expert: ``(rows [R, H], local expert of
    each row [R], weight of each row [R], sort order [T k], counts [2, ep, E / ep])``."""
    return _dispatch(x, index, weights, num_experts, group)


@ep_dispatch.register_fake
def _(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int, group: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = torch.library.get_ctx().new_dynamic_size()
    size = _group(group).size
    return (
        x.new_empty(rows, x.shape[-1]),
        index.new_empty(rows),
        weights.new_empty(rows),
        index.new_empty(index.numel()),
        index.new_empty(2, size, num_experts // size),
    )


def _combine(
    y: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, top_k: int, key: str
) -> torch.Tensor:
    g = _group(key)
    send, recv = _splits(counts)
    back = _all_to_all(y, recv, send, g)  # in the sorted order of this rank's pairs
    pairs = torch.empty_like(back)
    pairs[order] = back
    return pairs.view(-1, top_k, y.shape[-1]).sum(dim=1)


@torch.library.custom_op("mpar::ep_combine", mutates_args=())
def ep_combine(
    y: torch.Tensor,
    rows: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    group: str,
) -> torch.Tensor:
    """The experts' output rows ``y [R, H]`` (of :func:`ep_dispatch`'s ``rows``) sent back
    to their tokens' ranks and summed over each token's ``top_k`` pairs: ``[T, H]``.

    ``rows`` is not read: it ties this operator's backward to the dispatch's on every
    rank, so that every rank of the group joins both backward all-to-alls even where
    its experts got no rows (and ``y`` depends on no parameter)."""
    return _combine(y, order, counts, top_k, group)


@ep_combine.register_fake
def _(
    y: torch.Tensor,
    rows: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    group: str,
) -> torch.Tensor:
    return y.new_empty(order.shape[0] // top_k, y.shape[-1])


def _dispatch_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, index, weights, _, group = inputs
    ctx.save_for_backward(output[3], output[4])
    ctx.meta = (x.shape, x.dtype, index.shape[-1], weights.shape, weights.dtype, group)


def _dispatch_backward(ctx: Any, gx: Any, _ids: Any, gw: Any, _order: Any, _counts: Any) -> Any:
    """The rows' (and weights') gradients back to their tokens, summed over the pairs."""
    order, counts = ctx.saved_tensors
    shape, dtype, k, w_shape, w_dtype, group = ctx.meta
    rows = int(counts[1].sum())
    gx = torch.zeros(rows, shape[-1], dtype=dtype, device=order.device) if gx is None else gx
    gw = torch.zeros(rows, dtype=w_dtype, device=order.device) if gw is None else gw
    send, recv = _splits(counts)
    back = _all_to_all(_pack(gx.to(dtype), gw.to(w_dtype)), recv, send, _group(group))
    sorted_x, sorted_w = _unpack(back, shape[-1], dtype, w_dtype)
    pair_x, pair_w = torch.empty_like(sorted_x), torch.empty_like(sorted_w)
    pair_x[order], pair_w[order] = sorted_x, sorted_w
    return pair_x.view(-1, k, shape[-1]).sum(dim=1), None, pair_w.view(w_shape), None, None


def _combine_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    y, _, order, counts, top_k, group = inputs
    ctx.save_for_backward(order, counts)
    ctx.meta = (top_k, group, y.dtype, y.shape[-1])


def _combine_backward(ctx: Any, grad: torch.Tensor | None) -> Any:
    """Each pair's gradient (its token's) to the rank of its expert, in received order."""
    order, counts = ctx.saved_tensors
    top_k, group, dtype, width = ctx.meta
    send, recv = _splits(counts)
    if grad is None:  # every rank of the group still joins the all-to-all
        grad = torch.zeros(order.numel() // top_k, width, dtype=dtype, device=order.device)
    pairs = grad.repeat_interleave(top_k, dim=0)
    return _all_to_all(pairs[order], send, recv, _group(group)), None, None, None, None, None


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# ------------------------------------------------------------------ router statistics
def _sum(x: torch.Tensor, key: str) -> torch.Tensor:
    g = _group(key)
    out = x.detach().contiguous().clone()
    if g.size > 1:
        with Waiting(("collective", "all_reduce (router statistics)", g.group)):
            dist.all_reduce(out, group=g.group)
    return out


@torch.library.custom_op("mpar::batch_sum", mutates_args=())
def batch_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    """``x`` summed over the group; backward: the gradient summed over the group (every
    rank's loss uses the sum, so each rank's share gets every rank's gradient)."""
    return _sum(x, group)


@batch_sum.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _sum_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group = inputs[1]


def _sum_backward(ctx: Any, grad: torch.Tensor) -> Any:
    return batch_sum(grad, ctx.group), None


batch_sum.register_autograd(_sum_backward, setup_context=_sum_setup)
