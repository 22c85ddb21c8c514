"""Attention on one block of queries and keys, with its log-sum-exp (pure torch, no processes).

Context parallelism computes a rank's attention as a sum over blocks — its queries
against one piece of the keys at a time — and merges the blocks' results with the
online softmax (flash attention's, ring attention's): for one query row, a block gives
``out_b = softmax(s_b) @ v_b`` and ``lse_b = logsumexp(s_b)`` over its keys, and two
blocks merge as ``lse = logaddexp(lse_1, lse_2)``, ``out = out_1 * exp(lse_1 - lse) +
out_2 * exp(lse_2 - lse)``. A row that sees no key of a block has ``lse_b = -inf`` and
adds nothing.

The backward of one block needs only the *final* output and log-sum-exp of its rows
(``p = exp(s - lse)``, ``delta = rowsum(dout * out)``), so each block's gradients are
computed independently and summed: ``dq`` over the blocks of a query, ``dk``/``dv``
over the blocks of a key.

A block's mask is one of :data:`FULL` (every query sees every key), :data:`CAUSAL`
(queries and keys are the same run of tokens: the top-left triangle) or a boolean
tensor broadcastable to ``[batch, 1, queries, keys]`` (True: attend). Blocks that see
nothing are never computed.

Two kernels, the same numbers: on the CPU torch's fused flash-attention kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the
final ``out`` and ``lse``); elsewhere plain matmuls in float32, tiled over the
queries so that a block's scores stay small. Grouped-query attention (fewer key/value
heads) is handled here: ``q`` has ``heads = groups * kv_heads``.
"""

from __future__ import annotations

import math
from typing import Final

import torch

__all__ = ["CAUSAL", "FULL", "BlockMask", "block_backward", "block_forward", "merge_into"]

FULL: Final = "full"
CAUSAL: Final = "causal"
BlockMask = torch.Tensor | str
""":data:`FULL`, :data:`CAUSAL`, or a bool tensor broadcastable to [B, 1, Sq, Sk]."""

_TILE_ELEMENTS = 1 << 24
"""Most score elements one matmul tile holds (64 MiB of float32) on the math kernel."""


def _grouped(k: torch.Tensor, groups: int) -> torch.Tensor:
    """``k`` ([B, Hkv, S, D]) with each key/value head repeated for its query heads."""
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.tensor(-math.inf, dtype=dtype, device=mask.device))


def _causal(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    scale: float,
    *,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of queries ``q`` [B, H, Sq, D] on keys/values ``k``, ``v``
    [B, Hkv, Sk, D]: ``out`` in float32 [B, H, Sq, D], ``lse`` float32 [B, H, Sq]
    (``-inf`` for a row that sees no key). ``fused``: torch's CPU flash kernel (the
    device seam decides: ``mpar._device.has_cpu_flash_attention``), else float32
    matmuls."""
    groups = q.shape[1] // k.shape[1]
    if fused:
        return _fused_forward(q, _grouped(k, groups), _grouped(v, groups), mask, scale)
    return _math_forward(q, k, v, mask, scale)


def _fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if isinstance(mask, str):
        out, lse = kernel(q, k, v, 0.0, mask == CAUSAL, scale=scale)
        return out.float(), lse
    out, lse = kernel(q, k, v, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale)
    seen = mask.any(-1).expand(lse.shape)  # the kernel gives 0, not -inf, to blind rows
    return out.float(), lse.masked_fill(~seen, -math.inf)


def _scores(
    q: torch.Tensor, k: torch.Tensor, mask: BlockMask, rows: slice, scale: float
) -> torch.Tensor:
    """Float32 scores [B, Hkv, g, rows, Sk] of a tile of query rows, masked with -inf."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    qt = q[:, :, rows].float().view(b, hkv, h // hkv, -1, d)
    s = torch.matmul(qt, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if mask == CAUSAL:
        allowed = _causal(q.shape[2], k.shape[2], q.device)[rows]
        return s.masked_fill(~allowed, -math.inf)
    if isinstance(mask, torch.Tensor):
        return s.masked_fill(~mask[..., rows, :].unsqueeze(2), -math.inf)
    return s


def _tiles(q: torch.Tensor, keys: int) -> list[slice]:
    rows = max(1, _TILE_ELEMENTS // max(1, q.shape[0] * q.shape[1] * keys))
    return [slice(i, min(i + rows, q.shape[2])) for i in range(0, q.shape[2], rows)]


def _math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, sq, _ = q.shape
    out = q.new_empty((b, h, sq, v.shape[-1]), dtype=torch.float32)
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    for rows in _tiles(q, k.shape[2]):
        s = _scores(q, k, mask, rows, scale)
        tile_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(tile_lse).unsqueeze(-1))
        tile_out = torch.matmul(p, v.float().unsqueeze(2))
        out[:, :, rows] = tile_out.reshape(b, h, -1, v.shape[-1])
        lse[:, :, rows] = tile_lse.reshape(b, h, -1)
        del s, p
    return out, lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see nothing) as 0: ``exp(s - 0)`` of their -inf
    scores is 0, where ``exp(-inf - -inf)`` would be NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge one block's ``(block_out, block_lse)`` into the running ``(out, lse)`` of the
    same query rows, in place (both float32; ``lse`` -inf where nothing was seen yet)."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    old_w = torch.exp(lse - safe).unsqueeze(-1)
    new_w = torch.exp(block_lse - safe).unsqueeze(-1)
    out.mul_(old_w).add_(block_out * new_w)
    lse.copy_(new)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: BlockMask,
    scale: float,
    *,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 gradients ``(dq, dk, dv)`` of one block, from the rows' *final* ``out``
    and ``lse`` (see the module docstring); ``dk``, ``dv`` have ``k``'s heads;
    ``fused`` as for :func:`block_forward`."""
    groups = q.shape[1] // k.shape[1]
    if fused:
        return _fused_backward(dout, q, k, v, out, lse, mask, scale, groups)
    return _math_backward(dout, q, k, v, out, lse, mask, scale)


def _fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: BlockMask,
    scale: float,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dtype = q.dtype
    kg, vg = _grouped(k, groups), _grouped(v, groups)
    args = (dout.to(dtype), q, kg, vg, out.to(dtype), _finite(lse))
    if isinstance(mask, str):
        dq, dk, dv = kernel(*args, 0.0, mask == CAUSAL, scale=scale)
    else:
        dq, dk, dv = kernel(*args, 0.0, False, attn_mask=_additive(mask, dtype), scale=scale)
    if groups > 1:
        b, h, s, d = dk.shape
        dk = dk.view(b, h // groups, groups, s, d).sum(2)
        dv = dv.view(b, h // groups, groups, s, dv.shape[-1]).sum(2)
    return dq.float(), dk.float(), dv.float()


def _math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: BlockMask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, _, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    for rows in _tiles(q, k.shape[2]):
        s = _scores(q, k, mask, rows, scale)
        tile_lse = _finite(lse[:, :, rows].reshape(b, hkv, g, -1))
        p = torch.exp(s - tile_lse.unsqueeze(-1))
        do = dout[:, :, rows].float().reshape(b, hkv, g, -1, dout.shape[-1])
        o = out[:, :, rows].float().reshape(b, hkv, g, -1, out.shape[-1])
        delta = (do * o).sum(-1, keepdim=True)
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
        dq[:, :, rows] = (torch.matmul(ds, kf) * scale).reshape(b, h, -1, d)
        qt = q[:, :, rows].float().reshape(b, hkv, g, -1, d)
        dk += (torch.matmul(ds.transpose(-1, -2), qt) * scale).sum(2)
        del s, p, ds
    return dq, dk, dv
