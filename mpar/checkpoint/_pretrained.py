"""``mpar.load_pretrained`` and ``mpar.save_pretrained``: Hugging Face safetensors
checkpoints, each rank reading and writing only what it stores.

Loading checks the checkpoint's keys and shapes against the model at once
(missing keys, unexpected keys, shape mismatches are one error naming them),
then, on a partitioned model, every rank reads exactly the elements it stores
(``mpar.meta._owned``); on a model not yet partitioned that is built on the
meta device, the read waits until the model is partitioned (the first step);
on a real model not yet partitioned, the whole module is loaded.

Saving lays the tensors out in files the same way on every rank, rank 0 writes
the headers, then every rank writes the elements it owns straight into the
files (a ZeRO-3 shard, a part of a replicated tensor): the model is never
gathered. Rank 0 adds the index and, for a Hugging Face model, ``config.json``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mpar.checkpoint._safetensors import (
    Checkpoint,
    create_files,
    parse_size,
    plan_files,
    write_index,
    write_range,
)
from mpar.comm import state
from mpar.comm._collectives import all_gather_object_pp, barrier
from mpar.errors import MparError

__all__ = ["PretrainedKeyError", "load_pretrained", "save_pretrained"]

KeyMapping = Mapping[str, str] | Callable[[str], str] | None


class PretrainedKeyError(MparError, KeyError):
    """A checkpoint's keys or shapes do not match the model's."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _check_model(model: Any, fn: str) -> None:
    from mpar.runtime import DistributedModel

    if not isinstance(model, DistributedModel):
        raise TypeError(f"mpar.{fn} takes an mpar.DistributedModel, got {type(model).__name__}")


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


def _ignored(module: Any) -> list[re.Pattern[str]]:
    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []
    return [re.compile(p) for p in patterns]


def _match(model: Any, ckpt: Checkpoint, key_mapping: KeyMapping, strict: bool) -> dict[str, str]:
    """Model key (canonical, one per tensor) -> checkpoint key; raises on a mismatch."""
    to_model = _mapper(key_mapping)
    by_model: dict[str, str] = {}
    unexpected: list[str] = []
    known = set(model._key_order)
    ignored = _ignored(model.module)
    for ckey in ckpt.shapes:
        mkey = to_model(ckey)
        if mkey in known:
            by_model.setdefault(mkey, ckey)
        elif not any(p.search(ckey) for p in ignored):
            unexpected.append(ckey)
    out: dict[str, str] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    seen: set[str] = set()
    for key in model._key_order:
        if key in seen:
            continue
        names = [key, *model._aliases.get(key, ())]
        seen.update(names)
        found = next((by_model[n] for n in names if n in by_model), None)
        if found is None:
            missing.append(key)
            continue
        want, got = model._shapes[key], ckpt.shapes[found]
        if want != got:
            mismatched.append(
                f"{found!r}: checkpoint {tuple(got)}, model {tuple(want)} (model key {key!r})"
            )
        out[key] = found
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
    return out


def load_pretrained(
    model: Any,
    path: str | os.PathLike[str],
    *,
    key_mapping: KeyMapping = None,
    strict: bool = True,
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
    shapes). Before the model is partitioned, a model built on the meta device
    is loaded when it is (at its first step). Collective: call it on every rank.
    """
    _check_model(model, "load_pretrained")
    ckpt = Checkpoint(path)
    matched = _match(model, ckpt, key_mapping, strict)
    if model.partitioned:
        _load_partitioned(model, ckpt, matched)
    elif any(t.is_meta for t in model.module.state_dict().values()):
        model.after_partition.append(_DeferredLoad(ckpt, matched, model._aliases))
    else:
        _load_whole(model, ckpt, matched)


class _DeferredLoad:
    """``load_pretrained`` of a meta model, run once it is partitioned. ``overwrites``
    names every tensor it writes whole, so that materializing skips their init."""

    def __init__(
        self, ckpt: Checkpoint, matched: Mapping[str, str], aliases: Mapping[str, Any]
    ) -> None:
        self.ckpt, self.matched = ckpt, matched
        self.overwrites = {n for key in matched for n in [key, *aliases.get(key, ())]}

    def __call__(self, model: Any) -> None:
        _load_partitioned(model, self.ckpt, self.matched)


def _load_whole(model: Any, ckpt: Checkpoint, matched: Mapping[str, str]) -> None:
    state = model.module.state_dict()
    with torch.no_grad():
        for key, ckey in matched.items():
            t = state[key]
            t.copy_(ckpt.read(ckey, 0, t.numel()).reshape(t.shape))


def _load_partitioned(model: Any, ckpt: Checkpoint, matched: Mapping[str, str]) -> None:
    from mpar.meta._owned import fill_bucket, local_shares, stored_range

    per_bucket: dict[int, tuple[Any, dict[int, tuple[int, torch.Tensor]]]] = {}
    with torch.no_grad():
        for key, share in local_shares(model).items():
            if key not in matched:
                continue
            start, stop = stored_range(share)
            values = _read(ckpt, matched[key], share, model.grid.tp_rank, start, stop)
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


def _read(
    ckpt: Checkpoint, ckey: str, share: Any, tp_rank: int, start: int, stop: int
) -> torch.Tensor:
    """Elements ``[start, stop)`` of what this rank holds of ``share``: of the tensor, or
    of its tensor-parallel piece (only the piece's blocks are read)."""
    if share.split is None:
        return ckpt.read(ckey, start, stop)
    boxes = share.split.boxes(share.shape, tp_rank)
    return ckpt.read_piece(ckey, share.split.dim, boxes).reshape(-1)[start:stop]


# ---------------------------------------------------------------------------- saving


def save_pretrained(
    model: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write ``model`` as a Hugging Face safetensors checkpoint in directory ``path``.

    Files of at most ``max_shard_size`` (bytes, or ``"5GB"``, ``"200MiB"``) plus
    ``model.safetensors.index.json`` when there are several, and ``config.json``
    for a Hugging Face model: ``transformers``' ``from_pretrained`` reads it. The
    tensors keep the model's dtypes (the optimizer's full-precision values under
    mixed precision); a tied weight is saved once, under its first name. Each rank
    writes the elements it owns; nothing is gathered. Collective: call it on every
    rank.
    """
    _check_model(model, "save_pretrained")
    st = state()
    limit = parse_size(max_shard_size)
    root = Path(path)
    keys = _saved_keys(model)
    files = plan_files([(k, model._shapes[k], model._dtypes[k]) for k in keys], limit)
    if st.layout.rank == 0:
        create_files(root, files)
    barrier()
    layout_of = {key: layout for layout in files for key in layout.offsets}
    for key, start, values in _pieces(model):
        write_range(root, layout_of[key], key, start, values.to(model._dtypes[key]))
    barrier()
    if st.layout.rank == 0:
        write_index(root, files)
        config = getattr(model.module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(root)
    barrier()


def _saved_keys(model: Any) -> list[str]:
    """State-dict keys, each tensor once (tied aliases after the first left out)."""
    out: list[str] = []
    seen: set[str] = set()
    for key in model._key_order:
        if key not in seen:
            out.append(key)
            seen.update([key, *model._aliases.get(key, ())])
    return out


def _pieces(model: Any) -> list[tuple[str, int, torch.Tensor]]:
    """(key, first element, values) this rank writes."""
    from mpar.meta._owned import full_runs, local_shares, read_range, written_range

    if not model.partitioned:
        if any(t.is_meta for t in model.module.state_dict().values()):
            raise ValueError(
                "mpar.save_pretrained: the model is built on the meta device and has no "
                "values before its first step (or mpar.materialize)"
            )
        if state().layout.rank != 0:
            return []
        whole = model.module.state_dict()
        return [(k, 0, whole[k].reshape(-1)) for k in _saved_keys(model)]
    shares = local_shares(model)
    # The pipeline rank with the lowest stage holding a tensor writes it (tied copies).
    lowest: dict[str, int] = {}
    for part in all_gather_object_pp({k: s.stage for k, s in shares.items()}, model.grid):
        for key, stage in part.items():
            lowest[key] = min(stage, lowest.get(key, stage))
    out = []
    for key, share in shares.items():
        if share.stage != lowest[key]:
            continue
        if share.split is None and model.grid.tp_rank != 0:
            continue  # whole on every TP rank: TP rank 0 writes it
        start, stop = written_range(share, model.grid.dp_cp_rank)  # ZeRO shards over dp x cp
        if start < stop:
            values = read_range(share, start, stop)
            out += [(key, a, run) for a, run in full_runs(share, model.grid.tp_rank, start, values)]
    return out
