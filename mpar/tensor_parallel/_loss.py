"""A vocabulary-parallel cross-entropy: the loss of logits split on the vocabulary.

With the LM head ``"colwise"`` (its weight split by output rows, the vocabulary), each
TP rank holds ``vocab / tp`` logits per token; gathering them to compute the loss would
move ``batch x seq x vocab`` values. Megatron-LM's loss reduces three per-token numbers
over the TP group instead — the max logit, the sum of exponentials and the target's
logit — and its backward (``softmax - one_hot``) needs no communication. The operator is
``mpar.comm._tp_ops.vocab_parallel_ce``.
"""

from __future__ import annotations

import torch

from mpar.comm._tp_ops import TP_GROUP, vocab_parallel_ce

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits_piece: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``labels``, float32) of logits split on the last
    dim over the TP group (rank ``r`` holds vocabulary entries ``r * n`` to ``(r + 1) * n``,
    ``n = logits_piece.shape[-1]``). Tokens labelled ``ignore_index`` get 0 and no
    gradient. Take ``.mean()`` (over the kept tokens) as ``F.cross_entropy`` would.

    Every rank of the TP group must call it (it communicates); at tp = 1 it is the plain
    cross-entropy."""
    if not isinstance(logits_piece, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("vocab_parallel_cross_entropy takes two tensors: logits_piece, labels")
    if logits_piece.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits_piece has shape {tuple(logits_piece.shape)} and labels "
            f"{tuple(labels.shape)}: labels must have the logits' shape without the last "
            "(vocabulary) dim"
        )
    if labels.is_floating_point():
        raise TypeError(f"labels must hold class indices (an integer dtype), got {labels.dtype}")
    loss, _softmax = vocab_parallel_ce(logits_piece, labels, ignore_index, TP_GROUP)
    return loss
