"""Tensor-parallel collectives as differentiable operators inside captured stage graphs.

mpar's pipeline stages are graphs captured with ``torch.export`` and run eagerly,
so the module hooks that torch's DTensor styles install have no module left to
fire on, and an autograd function's backward is lost in capture. The
operators a tensor-parallel layer needs are therefore ``torch.library`` custom
operators with registered backward formulas (Megatron-LM's *f* and *g*, the
gather / split pair, and sequence parallelism's reduce-scatter). Capture keeps
each as one node; running the stage runs the operator and autograd uses its
formula:

=========================  ==============================  ========================
operator                   forward                         backward
=========================  ==============================  ========================
``tp_copy``                identity                        sum over the TP group
``tp_reduce``              sum over the TP group           identity
``tp_gather(d)``           concatenate the group's pieces  this rank's piece
                           along dim ``d``
``tp_split(d)``            this rank's piece along ``d``   concatenate along ``d``
``tp_reduce_scatter(d)``   sum over the TP group, then     concatenate along ``d``
                           this rank's piece along ``d``
=========================  ==============================  ========================

The communication runs on the TP process group of the grid (its ``DeviceMesh``'s
``"tp"`` dimension): an all-reduce, or an all-gather; a rank stuck in one shows in
the hang report like any other collective (the reduce-scatter is an all-reduce
and a slice on gloo, as ZeRO's is). (Wrapping the
pieces as DTensors and redistributing them was tried: inside an operator's
implementation torch 2.9's DTensor dispatch fails on ``detach_``, and the
collectives are the same.)

Operators name their group by a key registered with :func:`register_tp_group`;
:func:`clear_tp_groups` (run by ``mpar.shutdown``) forgets them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mpar.comm._progress import Waiting
from mpar.comm._shard_comm import reduce_scatter_flat
from mpar.comm._types import ProcessGroup

__all__ = [
    "TP_GROUP",
    "clear_tp_groups",
    "register_tp_group",
    "tp_groups_cleared",
    "tp_copy",
    "tp_gather",
    "tp_reduce",
    "tp_reduce_scatter",
    "tp_split",
    "vocab_parallel_ce",
]


@dataclass(frozen=True)
class _TPGroup:
    group: ProcessGroup
    size: int
    rank: int


_GROUPS: dict[str, _TPGroup] = {}

TP_GROUP = "tp"
"""The key of the grid's TP group (registered by ``mpar.init``)."""


def register_tp_group(key: str, group: ProcessGroup, size: int, rank: int) -> str:
    """Make ``group`` (this rank at ``rank`` of ``size``) known to the operators as ``key``."""
    _GROUPS[key] = _TPGroup(group, size, rank)
    return key


def clear_tp_groups() -> None:
    _GROUPS.clear()


def tp_groups_cleared() -> bool:
    return not _GROUPS


def _group(key: str) -> _TPGroup:
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(
            f"tensor-parallel group {key!r} is not registered in this process (a stage built "
            "for one mpar.init used after mpar.shutdown?)"
        ) from None


def _sum(x: torch.Tensor, key: str) -> torch.Tensor:
    g = _group(key)
    out = x.detach().contiguous().clone()
    if g.size > 1:
        with Waiting(("collective", "all_reduce", g.group)):
            dist.all_reduce(out, group=g.group)
    return out


def _concat(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    g = _group(key)
    x = x.detach().contiguous()
    if g.size == 1:
        return x.clone()
    pieces = [torch.empty_like(x) for _ in range(g.size)]
    with Waiting(("collective", "all_gather", g.group)):
        dist.all_gather(pieces, x, group=g.group)
    return torch.cat(pieces, dim=dim % x.dim())


def _piece(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    g = _group(key)
    return x.chunk(g.size, dim=dim)[g.rank].clone()


def _sum_piece(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    g = _group(key)
    dim = dim % x.dim()
    whole = x.detach().movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    piece = whole.new_empty((whole.shape[0] // g.size, *whole.shape[1:]))
    reduce_scatter_flat(piece.view(-1), whole.view(-1), group=g.group, size=g.size)
    return piece.movedim(0, dim).contiguous()


def _gathered_shape(x: torch.Tensor, dim: int, key: str) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] * _group(key).size
    return shape


def _split_shape(x: torch.Tensor, dim: int, key: str) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] // _group(key).size
    return shape


@torch.library.custom_op("mpar::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward, gradient summed over the TP group (Megatron's *f*)."""
    return x.clone()


@torch.library.custom_op("mpar::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the TP group forward, identity backward (Megatron's *g*)."""
    return _sum(x, group)


@torch.library.custom_op("mpar::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The TP group's pieces concatenated along ``dim``; backward: this rank's piece."""
    return _concat(x, dim, group)


@torch.library.custom_op("mpar::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim``; backward: the pieces concatenated."""
    return _piece(x, dim, group)


@torch.library.custom_op("mpar::tp_reduce_scatter", mutates_args=())
def tp_reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The sum over the TP group, this rank's piece of it along ``dim`` (a rowwise
    layer's output under sequence parallelism); backward: the pieces concatenated."""
    return _sum_piece(x, dim, group)


@tp_copy.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@tp_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@tp_gather.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return x.new_empty(_gathered_shape(x, dim % x.dim(), group))


@tp_split.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return x.new_empty(_split_shape(x, dim % x.dim(), group))


@tp_reduce_scatter.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return x.new_empty(_split_shape(x, dim % x.dim(), group))


class _Ctx(Protocol):
    """What the backward formulas keep: the operator's arguments after the tensor."""

    args: tuple[object, ...]


Grads = tuple[torch.Tensor | None, ...]


def _setup(ctx: _Ctx, inputs: tuple[object, ...], output: object) -> None:
    ctx.args = inputs[1:]


def _copy_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    (group,) = ctx.args
    assert isinstance(group, str)
    return tp_reduce(grad, group), None


def _reduce_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    return grad, None


def _gather_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    dim, group = ctx.args
    assert isinstance(dim, int) and isinstance(group, str)
    return tp_split(grad, dim, group), None, None


def _split_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    dim, group = ctx.args
    assert isinstance(dim, int) and isinstance(group, str)
    return tp_gather(grad, dim, group), None, None


tp_copy.register_autograd(_copy_backward, setup_context=_setup)
tp_reduce.register_autograd(_reduce_backward, setup_context=_setup)
tp_gather.register_autograd(_gather_backward, setup_context=_setup)
tp_split.register_autograd(_split_backward, setup_context=_setup)


# ------------------------------------------------- vocabulary-parallel cross-entropy
def _vocab_ce(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and the softmax of this rank's vocabulary piece (fp32)."""
    g = _group(group)
    x = logits.detach().float()
    piece = x.shape[-1]
    top = x.amax(dim=-1)
    if g.size > 1:  # a shift for exp: any value works, the group's max keeps it finite
        with Waiting(("collective", "all_reduce", g.group)):
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=g.group)
    exp = torch.exp(x - top.unsqueeze(-1))
    local = labels - g.rank * piece
    here = (local >= 0) & (local < piece)
    target = x.gather(-1, local.clamp(0, piece - 1).unsqueeze(-1)).squeeze(-1)
    sums = torch.stack([exp.sum(dim=-1), torch.where(here, target, torch.zeros_like(target))])
    if g.size > 1:  # the denominator and the target's logit, one all-reduce
        with Waiting(("collective", "all_reduce", g.group)):
            dist.all_reduce(sums, group=g.group)
    total, target = sums[0], sums[1]
    loss = torch.log(total) + top - target
    loss = torch.where(labels == ignore_index, torch.zeros_like(loss), loss)
    return loss, exp / total.unsqueeze(-1)


@torch.library.custom_op("mpar::vocab_parallel_ce", mutates_args=())
def vocab_parallel_ce(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits split on the vocabulary (the last dim) over the TP group:
    (per-token loss, this piece's softmax). Megatron-LM's: the max, the sum of
    exponentials and the target's logit are reduced over TP; the backward is local."""
    return _vocab_ce(logits, labels, ignore_index, group)


@vocab_parallel_ce.register_fake
def _(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return labels.new_empty(labels.shape, dtype=torch.float32), logits.new_empty(
        logits.shape, dtype=torch.float32
    )


def _ce_setup(ctx: Any, inputs: tuple[object, ...], output: object) -> None:
    logits, labels, ignore_index, group = inputs
    assert isinstance(logits, torch.Tensor) and isinstance(output, tuple)
    ctx.save_for_backward(labels, output[1])  # saved, not kept on ctx: no reference cycle
    ctx.args = (ignore_index, group, logits.dtype)


def _ce_backward(ctx: Any, grad_loss: torch.Tensor, _grad_softmax: torch.Tensor) -> Grads:
    """d loss / d logits = softmax - one_hot(target), on this rank's piece; nothing to
    communicate (each rank's softmax is already normalised over the whole vocabulary)."""
    labels, softmax = ctx.saved_tensors
    ignore_index, group, dtype = ctx.args
    piece = softmax.shape[-1]
    local = labels - _group(group).rank * piece
    here = ((local >= 0) & (local < piece)).unsqueeze(-1)
    one_hot = torch.zeros_like(softmax).scatter_(-1, local.clamp(0, piece - 1).unsqueeze(-1), 1.0)
    grad = softmax - torch.where(here, one_hot, torch.zeros_like(one_hot))
    scale = torch.where(labels == ignore_index, torch.zeros_like(grad_loss), grad_loss)
    return (grad * scale.unsqueeze(-1)).to(dtype), None, None, None


vocab_parallel_ce.register_autograd(_ce_backward, setup_context=_ce_setup)
tp_reduce_scatter.register_autograd(_split_backward, setup_context=_setup)
