"""Finding a model's attention and replacing it with the context-parallel operators.

Two kinds of attention are found, before anything of the model runs split:

* **Hugging Face's attention interface** (transformers 5: ``ALL_ATTENTION_FUNCTIONS``,
  chosen by ``config._attn_implementation``): mpar registers its own functions,
  ``"mpar_cp_ring"`` and ``"mpar_cp_all_to_all"``, and points the model's config (and
  every sub-config) at the one ``context_parallel_method`` names
  (:func:`install_hf`). Hugging Face then builds no mask of its own for them (an
  implementation without a mask function gets none): mpar's operators mask from the
  batch. Causality comes from the call's ``is_causal`` or the module's ``is_causal``;
  a ``sliding_window`` is honoured.
* **``torch.nn.functional.scaled_dot_product_attention``** calls, as the captured stage
  graphs hold them (``aten.scaled_dot_product_attention``): each node is pointed at
  :func:`sdpa_ring` or :func:`sdpa_all_to_all` (:func:`replace_sdpa`). A call with
  an ``attn_mask`` is refused (the mask would describe the rank's own tokens only): give
  the mask as the batch's ``attention_mask`` instead, or use ``is_causal``.

:data:`FOUND` counts the attention calls seen while the model was captured; a model
with none gets :class:`~mpar.errors.ContextParallelError`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mpar.comm import _process_state
from mpar.comm._cp_ops import (
    CP_GROUP,
    cp_local_attention,
    cp_ring_attention,
    cp_to_heads,
    cp_to_sequence,
)
from mpar.errors import ContextParallelError

__all__ = [
    "FOUND",
    "HF_NAMES",
    "attend",
    "check_heads",
    "hf_sdpa",
    "install_hf",
    "replace_sdpa",
    "sdpa_all_to_all",
    "sdpa_ring",
]

HF_NAMES = {"ring": "mpar_cp_ring", "all_to_all": "mpar_cp_all_to_all"}
"""The attention implementation mpar registers with Hugging Face, per method."""

FOUND = {"calls": 0}
"""Attention calls of Hugging Face models seen since the last reset (capture runs the
model's code; ``replace_sdpa`` counts the graph nodes it replaces itself)."""


def _size() -> int:
    from mpar.comm._cp_ops import _group

    return _group(CP_GROUP).size


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    causal: bool,
    window: int,
    method: str,
) -> torch.Tensor:
    """Attention of this rank's queries ``q`` [B, H, S/cp, D] on the whole sequence
    (``k``, ``v`` [B, Hkv, S/cp, D]) by ``method``: the output, shaped like ``q``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    heads, kv_heads, cp = q.shape[1], k.shape[1], _size()
    if heads % kv_heads:
        raise ContextParallelError(
            f"attention with {heads} query heads and {kv_heads} key/value heads: the "
            "query heads must be a multiple of the key/value heads (grouped-query attention)"
        )
    if method == "ring":
        out, _ = cp_ring_attention(q, k, v, scale, causal, window, CP_GROUP)
        return out
    if heads % cp:
        raise ContextParallelError(_heads_message(f"this attention has {heads} heads", cp))
    if kv_heads % cp:  # fewer key/value heads than ranks: each rank takes its queries' copy
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (cp_to_heads(t, CP_GROUP) for t in (q, k, v))  # any strides: one copy each
    out, _ = cp_local_attention(q, k, v, scale, causal, window)
    return cp_to_sequence(out, CP_GROUP)


def _heads_message(found: str, cp: int) -> str:
    return (
        f"context_parallel_method 'all_to_all' splits the attention heads over the "
        f"context_parallel_degree {cp} ranks, but {found} (per tensor-parallel rank); use a "
        "cp that divides the heads, or method 'ring'"
    )


def check_heads(module: nn.Module, cp: int, tp: int, method: str) -> None:
    """Refuse, when the model is wrapped, a Hugging Face model whose attention heads (per
    TP rank) the all-to-all cannot split over ``cp`` ranks (other models are checked at
    their first attention)."""
    if method != "all_to_all":
        return
    for config in _configs(module):
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int) and (heads // tp) % cp:
            found = f"{type(module).__name__} has {heads // tp} attention heads"
            raise ContextParallelError(_heads_message(found, cp))


# -- Hugging Face ----------------------------------------------------------------------


def _hf_function(method: str) -> Any:
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        FOUND["calls"] += 1
        _refuse(module, dropout, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = kwargs.get("sliding_window") or 0
        out = attend(
            query,
            key,
            value,
            scale=scaling,
            causal=bool(causal),
            window=int(window),
            method=method,
        )
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = HF_NAMES[method]
    return attention


def _refuse(module: nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    if dropout:
        raise ContextParallelError(
            f"{name} applies attention dropout {dropout} in training; context parallelism "
            "computes attention in blocks and does not draw dropout masks: set the "
            "model's attention dropout to 0"
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ContextParallelError(
                f"{name} calls its attention with {unsupported!r}, which mpar's context-"
                "parallel attention does not implement; use context_parallel_degree 1"
            )


def _register(method: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAMES[method], _hf_function(method))


def _configs(module: nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def is_hf(module: nn.Module) -> bool:
    """Whether ``module`` chooses its attention through Hugging Face's interface."""
    return bool(_configs(module))


@contextmanager
def hf_sdpa(module: nn.Module) -> Iterator[None]:
    """Hugging Face models in ``module`` attend through ``scaled_dot_product_attention``
    inside (what ``mpar.partition.measure_attention`` sees); restored after."""
    configs = _configs(module)
    saved = [c._attn_implementation for c in configs]
    for config in configs:
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for config, implementation in zip(configs, saved):
            config._attn_implementation = implementation


def _own_attention_code(module: nn.Module) -> list[str]:
    """transformers' modeling files ``module``'s classes come from, when none of them uses
    the attention interface (Falcon's and Bloom's attention is their own code: it branches
    on ``_attn_implementation == "sdpa"`` and is eager otherwise); else ``[]``."""
    files = {
        type(sub).__module__
        for sub in module.modules()
        if type(sub).__module__.startswith("transformers.models.")
    }
    if any(hasattr(sys.modules.get(f), "ALL_ATTENTION_FUNCTIONS") for f in files):
        return []
    return sorted(files)


def install_hf(module: nn.Module, method: str) -> bool:
    """Point every Hugging Face config in ``module`` at mpar's ``method`` attention;
    False when ``module`` has none (it is not a Hugging Face model). A Hugging Face model
    whose attention does not go through the interface is refused."""
    configs = _configs(module)
    if not configs:
        return False
    own = _own_attention_code(module)
    if own:
        raise ContextParallelError(
            f"context parallelism: {type(module).__name__} computes attention in its own code "
            "rather than through Hugging Face's attention interface "
            "(config._attn_implementation, transformers' ALL_ATTENTION_FUNCTIONS), which is "
            f"where mpar splits the sequence ({', '.join(own[:3])}); use "
            "context_parallel_degree 1 for it"
        )
    _register(method)
    for config in configs:
        config._attn_implementation = HF_NAMES[method]
    return True


# -- scaled_dot_product_attention in captured graphs --------------------------------------


def _sdpa(method: str) -> Any:
    def replacement(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        return attend(query, key, value, scale=scale, causal=is_causal, window=0, method=method)

    replacement.__name__ = f"mpar_cp_sdpa_{method}"
    return replacement


sdpa_ring = _sdpa("ring")
"""``scaled_dot_product_attention`` by the ring (see the module docstring)."""
sdpa_all_to_all = _sdpa("all_to_all")
"""``scaled_dot_product_attention`` by the all-to-all (see the module docstring)."""


def _check_sdpa_node(node: Any, where: str) -> None:
    args = list(node.args) + [None] * 6
    mask = node.kwargs.get("attn_mask", args[3])
    dropout = node.kwargs.get("dropout_p", args[4]) or 0.0
    if mask is not None:
        raise ContextParallelError(
            f"{where} calls scaled_dot_product_attention with an attn_mask; under context "
            "parallelism a mask the model builds covers only the rank's own tokens. Use "
            "is_causal=True, and give padding or document masks as the batch's "
            "attention_mask / position_ids (see docs/context_parallel.md)"
        )
    if dropout:
        raise ContextParallelError(
            f"{where} calls scaled_dot_product_attention with dropout_p {dropout}; context "
            "parallelism does not draw attention dropout: set it to 0"
        )


def replace_sdpa(stage: nn.Module, method: str, where: str) -> int:
    """Point the ``scaled_dot_product_attention`` calls of a captured stage's graphs at
    the ``method`` operators; returns how many calls it has (0 for a stage that is not
    a captured graph)."""
    programs = getattr(stage, "programs", None)
    replace = getattr(stage, "replace_calls", None)
    if programs is None or replace is None:
        return 0
    target = torch.ops.aten.scaled_dot_product_attention.default
    for program in programs.values():
        for node in program.graph.nodes:
            if node.op == "call_function" and node.target == target:
                _check_sdpa_node(node, where)
    return int(replace(target, sdpa_ring if method == "ring" else sdpa_all_to_all))


def _reset_found() -> None:
    FOUND["calls"] = 0


_process_state.register(
    "mpar.context_parallel._attention.FOUND", _reset_found, lambda: FOUND["calls"] == 0
)
