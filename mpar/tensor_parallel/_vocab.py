"""Vocabulary parallelism for Hugging Face causal language models, on by default at tp > 1.

Hugging Face's own plans (``base_model_tp_plan``) leave the token embedding and the LM
head whole, and those two are the largest tensors of a model with a large vocabulary
(Llama 3: 128256 x 8192 each, 2 GiB in bf16 apiece, with their gradients and optimizer
state 8 bytes more per element under AdamW). As Megatron-LM does, mpar splits both by
the vocabulary when the model's plan is its own or mpar's family plan (not a user's
``tp_plan``, which is taken as written): the embedding ``"embedding_rowwise"`` (rank ``r``
keeps vocabulary rows ``r * V/tp`` to ``(r + 1) * V/tp``; ids outside give zeros, summed
over TP) and the LM head ``"colwise"`` (the same rows of its weight: logits split on the
vocabulary). A head tied to the embedding (GPT-2) keeps the same rows of the one weight.

The model's loss from ``labels`` is then computed from the pieces with
:func:`~mpar.tensor_parallel.vocab_parallel_cross_entropy` (:func:`causal_lm_loss`, which
:func:`use_vocab_parallel_loss` installs as the model's ``loss_function``), so no rank
gathers ``batch x seq x vocab`` logits. This applies to any layout that splits the head of
a model using Hugging Face's causal-LM loss colwise, a user's plan included.

Where it applies (:func:`vocab_plan`): the model's ``get_output_embeddings()`` is an
``nn.Linear`` and its forward computes the loss with ``self.loss_function``, Hugging
Face's causal-LM loss (``...ForCausalLM``, ``GPT2LMHeadModel``; not T5 or BERT, whose
losses are computed inline), its ``get_input_embeddings()`` an ``nn.Embedding``, and the
vocabulary divides by tp (mpar does not pad). Elsewhere both stay as the plan has them.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpar.comm._tp_ops import vocab_parallel_ce
from mpar.tensor_parallel._tp_plan import Style

__all__ = ["causal_lm_loss", "use_vocab_parallel_loss", "vocab_plan"]


def _hf_causal_loss() -> object:
    """Hugging Face's causal-LM loss function (None when transformers is not loaded)."""
    losses = sys.modules.get("transformers.loss.loss_utils")
    return None if losses is None else getattr(losses, "ForCausalLMLoss", None)


def _calls_loss_function(module: nn.Module) -> bool:
    """Whether ``module``'s forward reads ``self.loss_function`` (some models, T5's, compute
    their loss inline while ``loss_function`` still names the causal-LM default)."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "loss_function" in code.co_names


def _causal_head(module: nn.Module) -> nn.Linear | None:
    """The LM head of a Hugging Face model whose forward computes its loss from ``labels``
    with the causal-LM loss, or None."""
    get_output = getattr(module, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    causal = _hf_causal_loss()
    if not isinstance(head, nn.Linear) or causal is None or not _calls_loss_function(module):
        return None
    loss = getattr(module, "loss_function", None)
    return head if loss is not None and inspect.unwrap(loss) is causal else None


def vocab_plan(module: nn.Module, tp: int) -> dict[str, str]:
    """Plan entries splitting ``module``'s token embedding and LM head by the vocabulary
    at TP degree ``tp`` (module name -> style), or ``{}`` where they do not apply (see the
    module docs)."""
    head = _causal_head(module)
    get_input = getattr(module, "get_input_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    if head is None or not isinstance(embedding, nn.Embedding) or tp < 2:
        return {}
    if head.out_features % tp or embedding.num_embeddings % tp:
        return {}
    names = {id(m): name for name, m in module.named_modules()}
    if id(head) not in names or id(embedding) not in names:
        return {}
    return {names[id(embedding)]: "embedding_rowwise", names[id(head)]: "colwise"}


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    group: str,
    **kwargs: object,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (labels shifted left, mean over the kept tokens, or
    their sum over ``num_items_in_batch``) from logits split on the vocabulary over the
    TP group ``group``; ``vocab_size`` is the whole vocabulary's (unused: the pieces say it)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    per_token, _softmax = vocab_parallel_ce(logits.float(), shift_labels, ignore_index, group)
    if num_items_in_batch is not None:
        return per_token.sum() / num_items_in_batch
    return per_token.sum() / (shift_labels != ignore_index).sum()


def use_vocab_parallel_loss(module: nn.Module, styles: dict[str, Style], group: str) -> bool:
    """Give ``module`` :func:`causal_lm_loss` as its ``loss_function`` when ``styles`` split
    its causal-LM head colwise (logits left split); returns whether it did."""
    head = _causal_head(module)
    if head is None:
        return False
    name = next((n for n, m in module.named_modules() if m is head), None)
    style = styles.get(name or "")
    if style is None or style.kind != "colwise" or style.gather_output:
        return False
    _replace_causal_loss(module, functools.partial(causal_lm_loss, group=group))
    return True


def _replace_causal_loss(module: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
    """Put ``loss`` where ``module``'s Hugging Face causal-LM loss is: its ``loss_function``
    itself, or the innermost ``__wrapped__`` of the wrappers around it (context
    parallelism's label shift, ``mpar.context_parallel._shard.ShiftedOverCP``, stays
    outside and hands the vocabulary-parallel loss its shifted labels and count)."""
    causal = _hf_causal_loss()
    holder: object = module
    attr = "loss_function"
    while getattr(holder, attr) is not causal:
        holder, attr = getattr(holder, attr), "__wrapped__"
    # Hugging Face's loss_function property has a setter; nn.Module's typing does not know it
    setattr(holder, attr, loss)
