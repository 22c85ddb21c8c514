"""Sharding each microbatch's sequences over the CP group, and what the model call needs.

Every rank of a CP group is given the same batch; after ``@mpar.step`` has split it into
microbatches, :func:`shard_microbatch` cuts each microbatch's sequences (axis 1,
batch-first) with the head-tail layout and keeps this rank's tokens:

* the sequence length is axis 1 of the tensor named ``input_ids`` (an argument or a
  dict key), else of the first tensor with two or more axes; every tensor whose axis 1
  has that length is sharded, the rest passed whole. The length must divide by
  ``2 * cp``.
* ``position_ids`` (by name) give the tokens' global positions and, where they restart,
  packed documents (then the layout is balanced per document); without them the
  positions are ``0 .. L-1``.
* ``attention_mask`` (by name): a 2-D padding mask [B, L] (1: a token, 0: padding) or
  a 4-D boolean / additive mask [B or 1, 1, L, L] (passed whole; the attention reads
  its rows and columns).
* ``labels`` (by name): with ``-100`` (ignored) entries, each rank's share of the valid
  tokens weighs its loss (:attr:`~mpar._cp_context.CPContext.loss_weight`), so that a
  token-mean loss is the whole sequence's.

:func:`prepare_call` then adapts the model call on every rank: it passes each rank's
global ``position_ids`` to a model that takes them. A Hugging Face causal LM's loss
shifts ``labels`` by one token, which crosses the ranks' pieces: :class:`CallPlan`
wraps the model's loss function so that the targets are shifted over the whole
sequence (``mpar.comm._cp_ops.cp_shift_labels``) and the sum is divided by the whole
microbatch's count of targets; each rank's loss is then its share of the sum, and the
CP group's losses add up (loss weight 1).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mpar._cp_context import CPContext, balanced_layout, document_ids
from mpar._targets import IGNORE_INDEX, Leaf, find_named, is_causal_lm, named_leaves
from mpar.comm._cp_ops import CP_GROUP, cp_shift_labels
from mpar.errors import ContextParallelError

__all__ = ["CallPlan", "prepare_call", "shard_microbatch"]


def _map(value: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], name: str) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(name, value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(v, fn, name) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(_map(v, fn, name) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map(v, fn, str(k))) for k, v in value.items())
    return value


def _length(leaves: list[Leaf], cp: int) -> int:
    seqs = [(n, t) for n, t in leaves if t.dim() >= 2]
    if not seqs:
        raise ContextParallelError(
            "context parallelism shards the sequences (axis 1) of the step's tensors, but "
            f"none of them has two axes (got {[(n, tuple(t.shape)) for n, t in leaves]})"
        )
    name, tensor = next(((n, t) for n, t in seqs if n == "input_ids"), seqs[0])
    length = int(tensor.shape[1])
    if length % (2 * cp):
        fit = -(-length // (2 * cp)) * 2 * cp
        raise ContextParallelError(
            f"sequence length {length} (axis 1 of {name!r}) does not divide by 2 x "
            f"context_parallel_degree = {2 * cp}: each rank holds a head and a tail chunk of "
            f"every sequence. Pad the sequences to {fit} tokens (labels -100 and "
            "attention_mask 0 on the padding), or use a cp that divides the length by 2"
        )
    return length


def _masks(leaves: list[Leaf], length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(valid [B, L], given [B or 1, 1, L, L]) from the ``attention_mask``, if any."""
    mask = find_named(leaves, "attention_mask")
    if mask is None:
        return None, None
    if mask.dim() == 2 and mask.shape[1] == length:
        valid = mask.bool()
        return (None if bool(valid.all()) else valid), None
    if mask.dim() == 4 and tuple(mask.shape[-2:]) == (length, length):
        if mask.is_floating_point():  # additive: 0 where attended, very negative elsewhere
            return None, mask > torch.finfo(mask.dtype).min / 2
        return None, mask.bool()
    raise ContextParallelError(
        f"attention_mask of shape {tuple(mask.shape)} under context parallelism: give a "
        f"padding mask [batch, {length}] or a full mask [batch, 1, {length}, {length}]"
    )


def _positions(leaves: list[Leaf], length: int, device: torch.device) -> torch.Tensor:
    given = find_named(leaves, "position_ids")
    if given is not None and given.dim() == 2 and given.shape[1] == length:
        return given
    return torch.arange(length, device=device).unsqueeze(0)


def _loss_weight(context: CPContext, labels: torch.Tensor | None) -> float:
    """This rank's share of the valid labels (``1 / cp`` without labels)."""
    size = context.layout.size
    if labels is None:
        return 1.0 / size
    valid = labels != IGNORE_INDEX
    total = int(valid.sum())
    mine = int(context.layout.shard(valid, context.rank).sum())
    return mine / total if total else 1.0 / size


def shard_microbatch(
    args: tuple[object, ...],
    kwargs: dict[str, object],
    names: list[str],
    cp: int,
    rank: int,
) -> tuple[tuple[object, ...], dict[str, object], CPContext]:
    """This CP rank's share of one microbatch (``names``: the positional arguments'
    names) and its context; see the module docstring."""
    leaves = named_leaves(args, kwargs, names)
    length = _length(leaves, cp)
    device = next(t for _, t in leaves if t.dim() >= 2).device
    positions = _positions(leaves, length, device)
    given_positions = find_named(leaves, "position_ids") is not None
    documents = document_ids(positions) if given_positions else None
    valid, given = _masks(leaves, length)
    layout = balanced_layout(length, cp, None if documents is None else documents.cpu())
    context = CPContext(layout, rank, positions, documents, valid, given)
    context.loss_weight = _loss_weight(context, find_named(leaves, "labels"))

    def cut(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() < 2 or tensor.shape[1] != length or tensor.dim() == 4:
            return tensor
        return layout.shard(tensor, rank)

    return _map(args, cut, ""), _map(kwargs, cut, ""), context


# -- the model call --------------------------------------------------------------------------


class CallPlan:
    """What :func:`prepare_call` does to one model's calls (read once from the model; a
    Hugging Face causal LM's loss function is wrapped here, see :class:`ShiftedOverCP`)."""

    def __init__(self, module: nn.Module) -> None:
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        self.takes_positions = "position_ids" in params
        """The model's forward takes ``position_ids`` (Hugging Face's convention)."""
        self.causal_lm = is_causal_lm(module)
        """A Hugging Face causal LM: its loss shifts ``labels`` along the sequence."""
        if self.causal_lm:
            wrapped = ShiftedOverCP(getattr(module, "loss_function"))  # noqa: B009
            setattr(module, "loss_function", wrapped)  # noqa: B010 - Hugging Face's setter


class ShiftedOverCP:
    """Hugging Face's causal-LM loss with the labels shifted over the whole sequence
    (``cp_shift_labels``: the next token may be on another CP rank) and divided by the
    whole microbatch's count of targets: each rank's loss is its share of the sum.

    The loss it wraps is its ``__wrapped__`` (``inspect.unwrap``'s convention) and is
    looked up at each call: tensor parallelism puts its vocabulary-parallel loss there
    (``mpar.tensor_parallel._vocab.use_vocab_parallel_loss``), under this shift."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.__wrapped__ = inner

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            shift_labels, count = cp_shift_labels(labels, ignore_index, CP_GROUP)
            num_items_in_batch = count if num_items_in_batch is None else num_items_in_batch
        return self.__wrapped__(
            logits,
            labels,
            vocab_size,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            shift_labels=shift_labels,
            **kwargs,
        )


def _batch_size(kwargs: dict[str, object], args: tuple[object, ...]) -> int:
    leaves = named_leaves(args, kwargs, [])
    return next((int(t.shape[0]) for _, t in leaves if t.dim() >= 2), 1)


def prepare_call(
    plan: CallPlan,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    context: CPContext | None,
) -> dict[str, object]:
    """``kwargs`` of a model call under context parallelism (see the module docstring)."""
    if context is None:
        return kwargs
    out = dict(kwargs)
    if plan.takes_positions and out.get("position_ids") is None:
        b = _batch_size(kwargs, args)
        local = context.local_positions()
        out["position_ids"] = local.expand(b, local.shape[1]).contiguous()
    if plan.causal_lm and out.get("labels") is not None:
        context.loss_weight = 1.0  # each rank's loss is its share of the sum already
    return out
