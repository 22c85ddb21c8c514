"""``mpar.load_pretrained`` and ``mpar.save_pretrained``: Hugging Face safetensors
checkpoints, each rank reading and writing only what it stores.

Loading checks the checkpoint's keys and shapes against the model at once
(missing keys, unexpected keys, shape mismatches are one error naming them),
then, on a partitioned model, every rank reads exactly the elements it stores
(``mpar.meta._owned``); on a model not yet partitioned that is built on the
meta device, the read waits until the model is partitioned (the first step);
on a real model not yet partitioned, the whole module is loaded.

Saving (:mod:`mpar.checkpoint._hf_save`) lays the tensors out in files the same
way on every rank, then every rank writes the elements it owns straight into the
files (a ZeRO-3 shard, a part of a replicated tensor): the model is never
gathered. The files are written beside the target folder and replace it in one
step once every rank has written and checked its part.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpar.checkpoint._common import CheckpointError
from mpar.checkpoint._expert_keys import Stacked, conversions_of, stacked_sources
from mpar.checkpoint._hf_save import check_model, save_pretrained
from mpar.checkpoint._safetensors import Checkpoint
from mpar.errors import MparError

if TYPE_CHECKING:
    from mpar.meta._owned import Share
    from mpar.runtime import DistributedModel
    from mpar.shard._bucket import FlatBucket

__all__ = ["PretrainedKeyError", "load_pretrained", "save_pretrained"]

KeyMapping = Mapping[str, str] | Callable[[str], str] | None
Source = str | Stacked
"""Where a model tensor is read from: a checkpoint key, or per-expert keys stacked."""


class PretrainedKeyError(MparError, KeyError):
    """A checkpoint's keys or shapes do not match the model's."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _mapper(key_mapping: KeyMapping) -> Callable[[str], str]:
    if key_mapping is None:
        return lambda k: k
    if callable(key_mapping):
        return key_mapping
    if not isinstance(key_mapping, Mapping):
        raise TypeError(
            "key_mapping must be a dict of regular expression -> replacement or a callable "
            f"(checkpoint key -> model key), got {type(key_mapping).__name__}"
        )
    rules = [(re.compile(pattern), repl) for pattern, repl in key_mapping.items()]

    def apply(key: str) -> str:
        for pattern, repl in rules:
            key = pattern.sub(repl, key)
        return key

    return apply


def _ignored(module: nn.Module) -> list[re.Pattern[str]]:
    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []
    return [re.compile(p) for p in patterns]


def _match(
    model: DistributedModel, ckpt: Checkpoint, key_mapping: KeyMapping, strict: bool
) -> dict[str, Source]:
    """Model key (canonical, one per tensor) -> checkpoint key (or the per-expert keys a
    fused expert weight stacks); raises on a mismatch."""
    to_model = _mapper(key_mapping)
    conversions = conversions_of(model.module)
    renamed = {conversions.rename(to_model(ckey)): ckey for ckey in ckpt.shapes}
    by_model: dict[str, str] = {}
    unexpected: list[str] = []
    known = set(model.state_keys.order)
    ignored = _ignored(model.module)
    for mkey, ckey in renamed.items():
        if mkey in known:
            by_model.setdefault(mkey, ckey)
        elif not any(p.search(ckey) for p in ignored):
            unexpected.append(ckey)
    out: dict[str, Source] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    seen: set[str] = set()
    for key in model.state_keys.order:
        if key in seen:
            continue
        names = list(model.state_keys.names_of(key))
        seen.update(names)
        found = next((by_model[n] for n in names if n in by_model), None)
        if found is None:
            missing.append(key)
            continue
        want, got = model.state_keys.shapes[key], ckpt.shapes[found]
        if want != got:
            mismatched.append(
                f"{found!r}: checkpoint {tuple(got)}, model {tuple(want)} (model key {key!r})"
            )
        out[key] = found
    stacked = stacked_sources(conversions, missing, model.state_keys.shapes, renamed, ckpt.shapes)
    out.update(stacked)
    missing = [k for k in missing if k not in stacked]
    consumed = {name for found in stacked.values() for name in found.names}
    unexpected = [k for k in unexpected if k not in consumed]
    problems = [f"shape mismatch: {m}" for m in mismatched]
    if strict:
        problems += [f"missing keys {missing[:10]}"] if missing else []
        problems += [f"unexpected keys {unexpected[:10]}"] if unexpected else []
    if problems:
        hint = "" if not strict or mismatched else " (strict=False loads the keys that match)"
        raise PretrainedKeyError(
            f"checkpoint {ckpt.root} does not fit {type(model.module).__name__}: "
            + "; ".join(problems)
            + hint
        )
    if not strict:
        _report_partial(model, ckpt, len(out), missing, unexpected)
    return out


def _report_partial(
    model: DistributedModel,
    ckpt: Checkpoint,
    loaded: int,
    missing: list[str],
    unexpected: list[str],
) -> None:
    """``strict=False``: raise when nothing matched, else warn (rank 0) with the counts."""
    total = loaded + len(missing)
    if loaded == 0:
        raise PretrainedKeyError(
            f"checkpoint {ckpt.root} shares no tensor with {type(model.module).__name__} "
            f"(0 of its {len(ckpt.shapes)} tensors match the model's {total}): checkpoint keys "
            f"look like {sorted(ckpt.shapes)[:3]}, model keys like {list(model.state_keys.order[:3])}. "
            "Is it another architecture? Rename keys with key_mapping={regex: replacement}"
        )
    if (missing or unexpected) and model.grid.rank == 0:
        warnings.warn(
            f"mpar.load_pretrained(strict=False) from {ckpt.root}: loaded {loaded} of the "
            f"model's {total} tensors; {len(missing)} missing kept their values "
            f"{missing[:5]}; {len(unexpected)} checkpoint tensors unused {unexpected[:5]}",
            stacklevel=4,
        )


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "floating point"
    return "complex" if dtype.is_complex else "integer"


def _check_casts(model: DistributedModel, ckpt: Checkpoint, matched: Mapping[str, Source]) -> None:
    """Refuse casts between dtype kinds (integer or bool to floating point, floating point
    to bool or integer): they lose values, and usually mean a key matched the wrong tensor."""
    lossy = []
    for key, ckey in matched.items():
        first = ckey if isinstance(ckey, str) else ckey.keys[0][0]
        have, want = ckpt.dtype(first), model.state_keys.dtypes[key]
        if _kind(have) != _kind(want):
            lossy.append(f"{ckey!r} ({str(have).removeprefix('torch.')} -> {want})")
    if lossy:
        raise CheckpointError(
            f"checkpoint {ckpt.root}: {len(lossy)} tensors would be cast to another kind of "
            f"dtype, which loses values: {lossy[:5]}. Check the key mapping, or pass "
            "allow_lossy_casts=True to mpar.load_pretrained to cast them anyway"
        )


def load_pretrained(
    model: DistributedModel,
    path: str | os.PathLike[str],
    *,
    key_mapping: KeyMapping = None,
    strict: bool = True,
    allow_lossy_casts: bool = False,
) -> None:
    """Load a Hugging Face safetensors checkpoint into ``model`` (a DistributedModel).

    ``path`` is a directory with ``model.safetensors`` or with shards and
    ``model.safetensors.index.json`` (or one ``.safetensors`` file). Each rank reads
    only the elements it stores; values are cast to the model's dtypes; a
    checkpoint without the second name of a tied weight (``lm_head.weight`` tied
    to the embeddings) is complete. ``key_mapping`` renames checkpoint keys to the
    model's: ``{regex: replacement}`` applied in order, or a callable. With
    ``strict`` (default) a missing or unexpected key is an error; a shape
    mismatch always is (:class:`PretrainedKeyError`, naming the keys and both
    shapes). ``strict=False`` loads what matches, warns with the counts of what
    did not, and raises when nothing matched. A cast between kinds of dtype
    (integer or bool into floating point, floating point into bool or integer)
    raises :class:`CheckpointError` unless ``allow_lossy_casts=True``; casts within
    a kind (bf16 into fp32) are made. Before the model is partitioned, a model
    built on the meta device is loaded when it is (at its first step).
    Collective: call it on every rank.
    """
    check_model(model, "load_pretrained")
    ckpt = Checkpoint(path)
    matched = _match(model, ckpt, key_mapping, strict)
    if not allow_lossy_casts:
        _check_casts(model, ckpt, matched)
    if model.partitioned:
        _load_partitioned(model, ckpt, matched)
    elif any(t.is_meta for t in model.module.state_dict().values()):
        model.after_partition.append(_DeferredLoad(ckpt, matched, model.state_keys.aliases))
    else:
        _load_whole(model, ckpt, matched)


class _DeferredLoad:
    """``load_pretrained`` of a meta model, run once it is partitioned. ``overwrites``
    names every tensor it writes whole, so that materializing skips their init."""

    def __init__(
        self,
        ckpt: Checkpoint,
        matched: Mapping[str, Source],
        aliases: Mapping[str, tuple[str, ...]],
    ) -> None:
        self.ckpt, self.matched = ckpt, matched
        self.overwrites = {n for key in matched for n in [key, *aliases.get(key, ())]}

    def __call__(self, model: DistributedModel) -> None:
        _load_partitioned(model, self.ckpt, self.matched)


def _load_whole(model: DistributedModel, ckpt: Checkpoint, matched: Mapping[str, Source]) -> None:
    state = model.module.state_dict()
    with torch.no_grad():
        for key, ckey in matched.items():
            t = state[key]
            t.copy_(_read_run(ckpt, ckey, 0, t.numel()).reshape(t.shape))


def _load_partitioned(
    model: DistributedModel, ckpt: Checkpoint, matched: Mapping[str, Source]
) -> None:
    from mpar.meta._owned import fill_bucket, local_shares, stored_range

    per_bucket: dict[int, tuple[FlatBucket, dict[int, tuple[int, torch.Tensor]]]] = {}
    if model.sharded is not None:  # the masters are written: no copy still reads them
        model.sharded.synchronize()
    with torch.no_grad():
        for key, share in local_shares(model).items():
            if key not in matched:
                continue
            start, stop = stored_range(share)
            values = _read(ckpt, matched[key], share, start, stop)
            if share.bucket is None:
                share.tensor.copy_(values.reshape(share.tensor.shape))
                continue
            assert share.slot is not None
            values = values.to(share.bucket.master_dtype)
            index = share.bucket.spec.slots.index(share.slot)
            entry = per_bucket.setdefault(id(share.bucket), (share.bucket, {}))
            entry[1][index] = (start, values)
            if len(entry[1]) == len(share.bucket.params):
                fill_bucket(*per_bucket.pop(id(share.bucket)))  # one bucket's values at a time
        for bucket, given in per_bucket.values():
            fill_bucket(bucket, given)


def _read_run(ckpt: Checkpoint, ckey: Source, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a checkpoint tensor (or of the fused weight stacked
    from per-expert keys: only the experts they cover are read)."""
    if isinstance(ckey, str):
        return ckpt.read(ckey, start, stop)
    sizes = [ckpt.shapes[keys[0]].numel() for keys in ckey.keys]
    return ckey.read(ckpt.read, sizes, start, stop)


def _read(ckpt: Checkpoint, ckey: Source, share: Share, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of what this rank holds of ``share``: of the tensor, or
    of its piece (TP, or a fused expert weight's rows: only the piece's blocks are read)."""
    if share.split is None:
        return _read_run(ckpt, ckey, start, stop)
    if not isinstance(ckey, str):  # this rank's experts: a run of rows of the fused weight
        rows = share.shape[0] // share.split.size
        first = share.split_rank * rows * share.shape[1:].numel()
        return _read_run(ckpt, ckey, first + start, first + stop)
    boxes = share.split.boxes(share.shape, share.split_rank)
    return ckpt.read_piece(ckey, share.split.dim, boxes).reshape(-1)[start:stop]
