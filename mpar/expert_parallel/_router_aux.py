"""Router auxiliary (load-balancing) losses as one process computes them.

Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) add
``router_aux_loss_coef * aux`` to their loss when ``output_router_logits`` is on, with
the Switch Transformer's balance loss over every token the forward saw::

    aux = E * sum_e f_e * P_e,   f_e = (pairs routed to e) / rows,
                                 P_e = (sum of router probabilities of e) / rows,

summed over the MoE layers (``rows`` counts a token once per layer; padding tokens,
under an attention mask, not at all). It is not a mean over tokens: the mean of two
half-batches' losses differs from the loss of the whole batch.

**What "one process" means here.** A step of ``M`` microbatches on ``dp`` data-parallel
ranks is the same as one process running the whole batch as ``M`` gradient-accumulation
chunks, chunk ``j`` being microbatch ``j`` of every data-parallel rank together (the
``dp`` ranks' ``j``-th microbatches side by side). With ``M = 1`` that is exactly one
process on the whole batch. Each rank therefore sums the three statistics over its
own tokens and then over its data-parallel group (:func:`mpar.comm._ep_ops.batch_sum`,
whose backward sums the gradient over the group too), so every rank computes chunk
``j``'s loss and the gradients are those of one process. Routing itself is per token
and needs nothing.

:func:`install_router_aux` makes a model do that: for the duration of its forward, its
modeling module's ``load_balancing_loss_func`` is :func:`router_aux_loss` over the
batch group (captured stages carry the operator).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mpar.comm._ep_ops import batch_sum

__all__ = ["AUX_FUNCTION", "install_router_aux", "router_aux_loss"]

AUX_FUNCTION = "load_balancing_loss_func"
"""The name of the balance loss in a Hugging Face MoE modeling module."""


def router_aux_loss(
    gate_logits: Any,
    num_experts: int | None = None,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
    *,
    group: str,
) -> torch.Tensor | int:
    """The balance loss of ``gate_logits`` (one ``[tokens, E]`` tensor per MoE layer),
    its statistics summed over ``group``; the same arguments as Hugging Face's."""
    if gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
        return 0
    device = gate_logits[0].device
    routed = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        if mask is None:
            routed = routed.index_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            routed = routed.index_add(0, chosen, mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    total = batch_sum(torch.cat([routed.detach(), probs, rows.detach()]), group)
    routed, probs, rows = total[:num_experts], total[num_experts:-1], total[-1]
    return torch.sum((routed / rows) * (probs / rows)) * num_experts


@contextlib.contextmanager
def _swapped(namespace: Any, name: str, value: object) -> Iterator[None]:
    saved = getattr(namespace, name)
    setattr(namespace, name, value)
    try:
        yield
    finally:
        setattr(namespace, name, saved)


def install_router_aux(module: nn.Module, group: str) -> bool:
    """Give ``module`` (a Hugging Face MoE model) a forward whose balance loss sums its
    statistics over ``group``; False (nothing done) for a model without one."""
    namespace = sys.modules.get(type(module).__module__)
    if namespace is None or not callable(getattr(namespace, AUX_FUNCTION, None)):
        return False
    exact = functools.partial(router_aux_loss, group=group)
    inner: Callable[..., Any] = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with _swapped(namespace, AUX_FUNCTION, exact):
            return inner(*args, **kwargs)

    module.forward = forward
    return True
