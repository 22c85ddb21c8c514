"""``load_checkpoint``: find the checkpoint, point DCP at this rank's storage, install.

Rank 0 resolves the path (root -> ``latest``, a directory, or a single-file
checkpoint of the earlier format) and broadcasts it. Each rank lists where its
share goes (:mod:`mpar.checkpoint._state`: views of its master values, fresh
buffers for optimizer state) and checks keys and shapes against the
checkpoint's metadata; the ranks agree; DCP reads the overlapping saved
chunks; the masters are published into the parameters and the optimizer gets
its state. Before the model is partitioned the optimizer part waits for the
first step (:meth:`mpar.DistributedOptimizer.defer_load`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import NamedTuple

import torch

from mpar._compat import CheckpointException, Metadata, TensorStorageMetadata, dcp, set_element
from mpar.checkpoint import _dirs
from mpar.checkpoint._async import wait_checkpoint
from mpar.checkpoint._common import FORMAT, CheckpointError, agree, check_model, describe_failure
from mpar.checkpoint._dcp import SafeLoadPlanner, SafeReader
from mpar.checkpoint._legacy import load_gathered
from mpar.checkpoint._state import (
    Entry,
    Install,
    OptimSection,
    Sections,
    load_model_targets,
    load_optimizer_targets,
    publish_masters,
)
from mpar.checkpoint._verify import check_files, read_metadata
from mpar.comm._checkpoint_comm import (
    all_gather_object_in,
    broadcast_object_in,
    checkpoint_group,
)
from mpar.comm._types import ProcessGroup
from mpar.runtime import DistributedModel, DistributedOptimizer

__all__ = ["PartialLoad", "load_checkpoint"]


def _resolve(path: Path, group: ProcessGroup | None, rank: int) -> tuple[str, Path]:
    decision: tuple[str, Path] | str | None = None
    if rank == 0:
        try:
            decision = _dirs.resolve(path)
            if decision[0] == "dcp":
                found = _dirs.read_marker(decision[1]).get("format")
                if found != FORMAT:
                    raise ValueError(f"{str(decision[1])!r} has format {found!r}, not {FORMAT!r}")
                check_files(decision[1])
        except (OSError, ValueError) as exc:
            decision = str(exc)
    decision = broadcast_object_in(decision, group)
    if not isinstance(decision, tuple):
        raise CheckpointError(str(decision))
    return decision[0], decision[1]


Saved = dict[tuple[str, ...], TensorStorageMetadata | None]
"""Every entry of a checkpoint by its path in the state dict: its tensor metadata, or
None for a non-tensor value."""


def _saved_shapes(metadata: Metadata) -> Saved:
    out: Saved = {}
    for flat, path in (metadata.planner_data or {}).items():
        md = metadata.state_dict_metadata[flat]
        out[tuple(str(p) for p in path)] = md if isinstance(md, TensorStorageMetadata) else None
    return out


class PartialLoad(NamedTuple):
    """What ``load_checkpoint(..., strict=False)`` returns: the ``user_content`` and
    the model entries it skipped (the same on every rank)."""

    user_content: object
    missing_keys: list[str]
    """Model keys the checkpoint has no entry for (left as they were)."""
    unexpected_keys: list[str]
    """Checkpoint entries the model has no key for (not read)."""
    mismatched_keys: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    """``(key, saved shape, model shape)`` of entries whose shapes differ (not read)."""


Mismatch = tuple[str, tuple[int, ...], tuple[int, ...]]
"""``(key, saved shape, model shape)``."""
Skipped = tuple[list[str], list[str], list[Mismatch]]
"""``(missing, unexpected, mismatched)`` model entries."""


def _match_targets(
    targets: dict[str, Entry],
    saved: Saved,
    model: DistributedModel,
    where: Path,
    strict: bool,
) -> Skipped:
    """Compare this rank's ``targets`` and the model's keys with the checkpoint:
    strict, raise naming every difference; else drop the targets that cannot be
    read and return (missing, unexpected, mismatched) as seen from this rank."""
    missing = [k for k in targets if ("model", k) not in saved]
    keys = set(model.state_keys.order)
    unexpected = sorted(p[1] for p in saved if p[0] == "model" and len(p) == 2 and p[1] not in keys)
    mismatched: list[Mismatch] = []
    for key, target in targets.items():
        md = saved.get(("model", key))
        if md is not None and torch.Size(md.size) != target.shape:
            mismatched.append((key, tuple(md.size), tuple(target.shape)))
    if strict and (missing or unexpected or mismatched):
        raise CheckpointError(_difference_text(where, missing, unexpected, mismatched))
    for key in missing + [m[0] for m in mismatched]:
        del targets[key]
    return missing, unexpected, mismatched


def _difference_text(
    where: Path, missing: list[str], unexpected: list[str], shapes: list[Mismatch]
) -> str:
    parts = []
    if missing:
        parts.append(f"no entries for {len(missing)} model keys {missing[:5]}")
    if unexpected:
        parts.append(f"{len(unexpected)} entries the model lacks {unexpected[:5]}")
    if shapes:
        listed = ", ".join(f"{k!r}: saved {s}, model {m}" for k, s, m in shapes[:5])
        parts.append(f"{len(shapes)} entries of another shape ({listed})")
    return (
        f"checkpoint {str(where)!r} does not fit the model: {'; '.join(parts)}. Was it saved "
        "from another model? Pass strict=False to load the entries that fit (it returns "
        "what it skipped)"
    )


def _union_skipped(
    skipped: Skipped, group: ProcessGroup | None, model: DistributedModel
) -> Skipped:
    """Every rank's skipped entries, merged, in the model's key order."""
    every = all_gather_object_in(skipped, group)
    position = {k: i for i, k in enumerate(model.state_keys.order)}
    missing = sorted({k for s in every for k in s[0]}, key=lambda k: position.get(k, 0))
    mismatched = sorted({m for s in every for m in s[2]}, key=lambda m: position.get(m[0], 0))
    return missing, skipped[1], mismatched


def _group_placeholders(saved: Saved) -> list[dict[str, object]]:
    """Where DCP puts the saved ``param_groups`` (empty tensors for tensor values)."""
    holder: dict[str, object] = {}
    for path, md in saved.items():
        if path[:2] == ("optim", "param_groups"):
            value = None if md is None else torch.empty(md.size, dtype=md.properties.dtype)
            key_path = tuple(int(p) if p.isdigit() else p for p in path)
            set_element(holder, key_path, value)
    optim = holder.get("optim", {})
    assert isinstance(optim, dict)
    return list(optim.get("param_groups", []))


def _read(directory: Path, group: ProcessGroup | None, sections: Sections) -> None:
    """DCP fills ``sections`` in place (its tensors, and ``mpar.extras``)."""
    try:
        dcp.load(
            sections,  # filled in place
            storage_reader=SafeReader(str(directory)),
            planner=SafeLoadPlanner(),
            process_group=group,
        )
    except (Exception, CheckpointException) as exc:  # on every rank when any rank failed
        raise CheckpointError(
            f"reading checkpoint {str(directory)!r} failed: {describe_failure(exc, directory)}"
        ) from None


class Extras(NamedTuple):
    """What rank 0 saved beside the tensors (``mpar.extras``)."""

    user_content: object
    loss_scaler: dict[str, float] | None


def _extras(sections: Sections) -> Extras:
    raw = sections.get("mpar", {}).get("extras")
    if not isinstance(raw, bytes):
        raise CheckpointError("the checkpoint holds no mpar extras (user_content, loss scale)")
    loaded = torch.load(io.BytesIO(raw), weights_only=True)
    return Extras(loaded.get("user_content"), loaded.get("loss_scaler"))


def _check_has_optimizer(saved: Saved, directory: Path) -> None:
    if not any(path[0] == "optim" for path in saved):
        raise CheckpointError(
            f"checkpoint {str(directory)!r} holds no optimizer state (it was saved without "
            "an optimizer): load it with optimizer=None"
        )


def _optimizer_sections(
    optimizer: DistributedOptimizer, model: DistributedModel, directory: Path, metadata: Metadata
) -> tuple[OptimSection, Install]:
    saved = _saved_shapes(metadata)
    _check_has_optimizer(saved, directory)
    targets, install = load_optimizer_targets(optimizer, model, metadata)
    return {"state": targets, "param_groups": _group_placeholders(saved)}, install


def _load_optimizer(
    directory: Path, model: DistributedModel, optimizer: DistributedOptimizer
) -> None:
    """Read and install this rank's optimizer state (collective)."""
    group = checkpoint_group(model.grid)
    error: str | None = None
    sections: Sections = {}
    install: Install | None = None
    try:
        metadata = read_metadata(directory)
        optim, install = _optimizer_sections(optimizer, model, directory, metadata)
        sections = {"optim": optim, "mpar": {"extras": None}}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    agree(error, group, f"loading the optimizer state of {str(directory)!r}")
    _read(directory, group, sections)
    _install(install, sections, optimizer, directory, group)


def _install(
    install: Install | None,
    sections: Sections,
    optimizer: DistributedOptimizer,
    where: Path,
    group: ProcessGroup | None,
) -> None:
    """Hand the optimizer its loaded state (every rank learns of any rank's failure)."""
    error = None
    try:
        if install is None or "optim" not in sections:
            raise KeyError("this rank listed no optimizer state")
        install(sections["optim"])
        _load_scaler(optimizer, _extras(sections))
    except (KeyError, ValueError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    agree(error, group, f"loading the optimizer state of {str(where)!r}")


def _load_scaler(optimizer: DistributedOptimizer, extras: Extras) -> None:
    sharded = optimizer.sharded_optimizer()
    scaler = None if sharded is None else sharded.sharded.scaler
    if scaler is not None and extras.loss_scaler is not None:
        scaler.load_state_dict(extras.loss_scaler)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: DistributedModel,
    optimizer: DistributedOptimizer | None = None,
    *,
    strict: bool = True,
) -> object:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns its ``user_content``.

    ``path`` is a checkpoint root (its ``latest`` is loaded), one checkpoint
    directory, or a single-file checkpoint of the earlier format. Collective;
    works before or after the model is partitioned and in any layout (before,
    the optimizer state is read at the first step). The files are checked
    first: a missing, truncated or unreadable file raises
    :class:`CheckpointError` naming it.

    ``strict`` (default True): the checkpoint's model entries must match the
    model's keys and shapes exactly, else :class:`CheckpointError` names the
    missing, unexpected and mismatched keys. ``strict=False`` loads the entries
    that fit and returns a :class:`PartialLoad` (``user_content`` and the keys it
    skipped) instead of the ``user_content``.
    """
    check_model(model, optimizer)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    wait_checkpoint()
    group = checkpoint_group(model.grid)
    kind, directory = _resolve(Path(path), group, model.grid.rank)
    if kind == "file":
        try:
            return load_gathered(directory, model, optimizer)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None
    error: str | None = None
    sections: Sections = {}
    install: Install | None = None
    skipped: Skipped = ([], [], [])
    try:
        metadata = read_metadata(directory)
        targets = load_model_targets(model)
        skipped = _match_targets(targets, _saved_shapes(metadata), model, directory, strict)
        sections = {"model": targets, "mpar": {"extras": None}}
        if optimizer is not None and model.partitioned:
            sections["optim"], install = _optimizer_sections(optimizer, model, directory, metadata)
        elif optimizer is not None:
            _check_has_optimizer(_saved_shapes(metadata), directory)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    agree(error, group, f"loading checkpoint {str(directory)!r}")
    _read(directory, group, sections)
    publish_masters(model)
    extras = _extras(sections)
    if optimizer is not None and install is not None:
        _install(install, sections, optimizer, directory, group)
    elif optimizer is not None:
        optimizer.defer_load(lambda: _load_optimizer(directory, model, optimizer))
    if strict:
        return extras.user_content
    return PartialLoad(extras.user_content, *_union_skipped(skipped, group, model))
