"""Full (torch-format) optimizer state from shards, and back.

The full form is exactly what ``torch.optim.Optimizer.state_dict()`` of the
unwrapped optimizer returns: ``state`` keyed by the original parameter
index, each element-wise tensor (``exp_avg``, ``momentum_buffer``...) in the
parameter's shape, and the other entries (``step``) as they are;
``param_groups`` with the original groups' options and indices. Gathering is
a collective over the data-parallel group; splitting is local.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mpar.comm._shard_comm import all_gather_flat, all_gather_objects

if TYPE_CHECKING:
    from mpar.shard._sharded_optimizer import SegmentParam, ShardedOptimizer

__all__ = ["SHARDED_FORMAT", "gather_full_state", "split_full_state"]

SHARDED_FORMAT = "mpar.zero.sharded.v1"


def _elementwise(value: object, numel: int) -> bool:
    """A segment's state entry that has one element per parameter element."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _param_shaped(key: str, value: object, shape: torch.Size) -> bool:
    """A full state entry that has the parameter's shape (not a 0-d ``step``)."""
    if not torch.is_tensor(value) or value.shape != shape:
        return False
    return not (value.dim() == 0 and key == "step")


def _to_host(value: object) -> object:
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


Summary = tuple[dict[int, dict[str, str]], dict[int, dict[str, object]]]
"""Element-wise state keys (with dtype) per bucket, and other entries per original index."""


def _local_summary(opt: ShardedOptimizer) -> Summary:
    """Element-wise keys (with dtype) per bucket, and other entries per original index."""
    keys: dict[int, dict[str, str]] = {}
    entries: dict[int, dict[str, object]] = {}
    for sp in opt.segments:
        state = opt.inner.state.get(sp.param)
        if not state:
            continue
        for piece in sp.segment.pieces:
            entries.setdefault(opt.original_index[piece.index], {})
        for key, value in state.items():
            if _elementwise(value, sp.segment.numel):
                keys.setdefault(sp.bucket_index, {})[key] = str(value.dtype).removeprefix("torch.")
                continue
            for piece in sp.segment.pieces:
                entries[opt.original_index[piece.index]][key] = _to_host(value)
    return keys, entries


def _merge(gathered: list[Summary]) -> Summary:
    keys: dict[int, dict[str, str]] = {}
    entries: dict[int, dict[str, object]] = {}
    for rank_keys, rank_entries in gathered:
        for b, names in rank_keys.items():
            keys.setdefault(b, {}).update(names)
        for index, values in rank_entries.items():
            merged = entries.setdefault(index, {})
            for key, value in values.items():
                merged.setdefault(key, value)
    return keys, entries


def _gather_key(opt: ShardedOptimizer, b: int, key: str, dtype: torch.dtype) -> torch.Tensor:
    """The padded flat buffer of state ``key`` of bucket ``b``, on the CPU."""
    sharded = opt.sharded
    bucket = sharded.buckets[b]
    lo, hi = bucket.opt_range
    local = torch.zeros(hi - lo, dtype=dtype, device=sharded.device)
    for sp in opt.segments:
        value = opt.inner.state.get(sp.param, {}).get(key) if sp.bucket_index == b else None
        if value is not None:
            sp.slice(local).copy_(value)
    if hi - lo == bucket.spec.padded:
        return local.cpu()
    flat = torch.empty(bucket.spec.padded, dtype=dtype, device=sharded.device)
    all_gather_flat(flat, local, group=bucket.comm.group, size=bucket.comm.size)
    return flat.cpu()


def gather_full_state(opt: ShardedOptimizer) -> dict[str, Any]:
    """The full torch-format state dict (collective over the group)."""
    comm = opt.sharded.comm
    keys, entries = _merge(
        all_gather_objects(_local_summary(opt), group=comm.group, size=comm.size)
    )
    state = {index: dict(values) for index, values in entries.items()}
    for b, bucket in enumerate(opt.sharded.buckets):
        for key in sorted(keys.get(b, {})):
            flat = _gather_key(opt, b, key, getattr(torch, keys[b][key]))
            for slot, shape in zip(bucket.spec.slots, bucket.shapes):
                index = opt.original_index.get(slot.index)
                if index in state:
                    view = flat[slot.offset : slot.offset + slot.numel]
                    state[index][key] = view.view(shape).clone()
    groups = []
    start = 0
    for size, group in zip(opt.group_sizes, opt.inner.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        if opt.fused_on_host:  # mpar's choice, not the user's: saved as the user set it
            options["fused"] = opt.user_fused
        groups.append({**options, "params": list(range(start, start + size))})
        start += size
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _check_groups(opt: ShardedOptimizer, groups: list[dict[str, Any]]) -> None:
    sizes = [len(g["params"]) for g in groups]
    if sizes != opt.group_sizes:
        raise ValueError(
            f"optimizer state_dict has parameter groups of sizes {sizes}, but the wrapped "
            f"optimizer had {opt.group_sizes}; it was saved from a different model or optimizer"
        )


def _segment_state(
    sp: SegmentParam,
    opt: ShardedOptimizer,
    state: dict[Any, dict[str, Any]],
    shapes: dict[int, torch.Size],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    offset = 0
    for piece in sp.segment.pieces:
        length = piece.stop - piece.start
        saved = state.get(opt.original_index[piece.index])
        for key, value in (saved or {}).items():
            if _param_shaped(key, value, shapes[piece.index]):
                buffer = out.setdefault(key, torch.zeros(sp.segment.numel, dtype=value.dtype))
                buffer[offset : offset + length].copy_(value.reshape(-1)[piece.start : piece.stop])
            elif key not in out:  # a copy: torch keeps ``step`` as given, one per parameter
                out[key] = value.clone() if torch.is_tensor(value) else value
        offset += length
    return out


def split_full_state(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The rebuilt optimizer's state dict for this rank's segments of a full one."""
    _check_groups(opt, state_dict["param_groups"])
    state = {int(k): v for k, v in state_dict["state"].items()}
    shapes = {
        slot.index: shape
        for bucket in opt.sharded.buckets
        for slot, shape in zip(bucket.spec.slots, bucket.shapes)
    }
    ids = {id(p): i for i, p in enumerate(p for g in opt.inner.param_groups for p in g["params"])}
    inner_state = {}
    for sp in opt.segments:
        seg_state = _segment_state(sp, opt, state, shapes)
        if seg_state:
            inner_state[ids[id(sp.param)]] = seg_state
    groups = []
    for saved, group in zip(state_dict["param_groups"], opt.inner.param_groups):
        options = {k: v for k, v in saved.items() if k != "params"}
        if opt.fused_on_host:
            options["fused"] = True
        groups.append({**options, "params": [ids[id(p)] for p in group["params"]]})
    return {"state": inner_state, "param_groups": groups}
