"""``mpar.save_pretrained``: a Hugging Face safetensors checkpoint written by every rank,
committed in one step.

The steps: every rank computes the same file layout and the elements it writes (its
ZeRO shard's part of each parameter, its TP piece, a tied weight once); rank 0
claims the folder (:func:`mpar.checkpoint._hf_dirs.claim`: the lock, the checks, a
temporary folder beside it), writes the headers and reserves every file's size on
disk, and tells the others; each rank writes its elements into the temporary
folder, flushes them to disk and reads them back; the ranks agree that all of them
succeeded; rank 0 adds the index, ``config.json`` and the marker, checks every
file's size and swaps the folder in (:func:`mpar.checkpoint._hf_dirs.commit`). A
failure anywhere removes the temporary folder and raises :class:`CheckpointError`
on every rank naming the cause (a full disk: the folder and the bytes needed); the
earlier save stays in place, whole.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mpar.checkpoint import _hf_dirs
from mpar.checkpoint._async import wait_checkpoint
from mpar.checkpoint._common import CheckpointError, agree
from mpar.checkpoint._safetensors import (
    FileLayout,
    create_files,
    parse_size,
    plan_files,
    write_index,
    write_ranges,
)
from mpar.checkpoint._save import PendingSave
from mpar.comm._checkpoint_comm import broadcast_object_in, checkpoint_group
from mpar.comm._collectives import all_gather_object_pp
from mpar.comm._types import ProcessGroup
from mpar.errors import MparError
from mpar.runtime import DistributedModel

__all__ = ["check_model", "save_pretrained"]

Piece = tuple[str, int, torch.Tensor]
"""(state-dict key, first element, values) that this rank writes."""


def check_model(model: object, fn: str) -> None:
    if not isinstance(model, DistributedModel):
        raise TypeError(f"mpar.{fn} takes an mpar.DistributedModel, got {type(model).__name__}")


def save_pretrained(
    model: DistributedModel,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> None:
    """Write ``model`` as a Hugging Face safetensors checkpoint in the folder ``path``.

    Files of at most ``max_shard_size`` (bytes, or ``"5GB"``, ``"200MiB"``) plus
    ``model.safetensors.index.json`` when there are several, and ``config.json``
    for a Hugging Face model: ``transformers``' ``from_pretrained`` reads it. The
    tensors keep the model's dtypes (the optimizer's full-precision values under
    mixed precision); a tied weight is saved once, under its first name. Each rank
    writes the elements it owns; nothing is gathered.

    Atomic: the files are written beside ``path`` and replace it in one step once
    every rank has written and checked its part, so ``path`` holds the earlier save
    or this one, whole, whatever happens. ``path`` may hold an earlier
    ``save_pretrained`` (replaced whole: saving every N steps into one folder); a
    folder holding anything else is refused unless ``overwrite=True``. A second job
    saving into ``path`` meanwhile is refused, naming this one. Collective: call it
    on every rank.
    """
    check_model(model, "save_pretrained")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    limit = parse_size(max_shard_size)
    wait_checkpoint()  # (an asynchronous checkpoint uses the same process group)
    group = checkpoint_group(model.grid)
    final = Path(os.path.realpath(path))
    keys = _saved_keys(model)
    files = plan_files(
        [(k, model.state_keys.shapes[k], model.state_keys.dtypes[k]) for k in keys], limit
    )
    pieces = _pieces(model)
    save = _prepare(final, files, overwrite, group, model.grid.rank)
    try:
        error = _write(save.tmp, files, pieces)
        agree(error, group, f"saving {str(final)!r}")
    except BaseException:
        save.abandon()
        raise
    error = _finish(save, files, model) if model.grid.rank == 0 else None
    try:
        error = broadcast_object_in(error, group)
    except RuntimeError as exc:
        raise CheckpointError(
            f"lost contact with rank 0 while it committed {str(final)!r} ({exc}); it holds "
            "the earlier save or this one, whole"
        ) from None
    if error is not None:
        raise CheckpointError(f"saving {str(final)!r} failed on rank 0: {error}")


def _no_room(final: Path, files: Sequence[FileLayout]) -> str:
    needed = sum(layout.size for layout in files)
    try:
        free = f"{shutil.disk_usage(final.parent).free} bytes free"
    except OSError:
        free = "free space unknown"
    return (
        f"no space left on device under {str(final.parent)!r}: the save needs {needed} bytes, "
        f"{free}; the partial files are removed"
    )


def _claim(final: Path, files: Sequence[FileLayout], overwrite: bool) -> PendingSave:
    """Rank 0: claim the folder and create the files (headers, space reserved)."""
    tmp, lock = _hf_dirs.claim(final, overwrite)
    save = PendingSave(tmp, final.name, lock)
    try:
        create_files(tmp, files)
    except OSError as exc:
        save.abandon()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(_no_room(final, files)) from None
        raise
    return save


def _prepare(
    final: Path,
    files: Sequence[FileLayout],
    overwrite: bool,
    group: ProcessGroup | None,
    rank: int,
) -> PendingSave:
    """Rank 0 claims the folder; every rank learns the temporary folder, or the error."""
    decision: Any = None
    save = None
    if rank == 0:
        try:
            save = _claim(final, files, overwrite)
            decision = save.tmp
        except (OSError, MparError) as exc:
            decision = f"{type(exc).__name__}: {exc}"
    decision = broadcast_object_in(decision, group)
    if isinstance(decision, str):
        raise CheckpointError(f"cannot save {str(final)!r}: {decision}")
    return save if save is not None else PendingSave(decision, final.name, None)


def _write(tmp: Path, files: Sequence[FileLayout], pieces: Sequence[Piece]) -> str | None:
    """This rank's pieces written into ``tmp``, on disk and read back; the error text."""
    layout_of = {key: layout for layout in files for key in layout.offsets}
    by_file: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_file.setdefault(layout_of[piece[0]].name, []).append(piece)
    try:
        for layout in files:
            if layout.name in by_file:
                write_ranges(tmp, layout, by_file[layout.name])
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return _no_room(tmp.parent / tmp.name, files)
        return f"{type(exc).__name__}: {exc}"
    except CheckpointError as exc:
        return str(exc)
    return None


def _finish(save: PendingSave, files: Sequence[FileLayout], model: DistributedModel) -> str | None:
    """Rank 0: index, config, marker, sizes checked, commit; the error text, or None."""
    try:
        write_index(save.tmp, files)
        config = getattr(model.module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(save.tmp)
        for layout in files:
            size = (save.tmp / layout.name).stat().st_size
            if size != layout.size:
                raise CheckpointError(f"{layout.name} has {size} bytes, {layout.size} expected")
        _hf_dirs.write_marker(save.tmp, {"world_size": model.grid.world_size, "time": time.time()})
        _hf_dirs.commit(save.tmp, save.final)
    except (OSError, MparError) as exc:
        save.abandon()
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return _no_room(save.final, files)
        return f"{type(exc).__name__}: {exc}"
    finally:
        save.release()
    return None


def _saved_keys(model: DistributedModel) -> list[str]:
    """State-dict keys, each tensor once (tied aliases after the first left out)."""
    out: list[str] = []
    seen: set[str] = set()
    for key in model.state_keys.order:
        if key not in seen:
            out.append(key)
            seen.update(model.state_keys.names_of(key))
    return out


def _pieces(model: DistributedModel) -> list[Piece]:
    """The elements this rank writes, in the saved dtypes."""
    from mpar.meta._owned import full_runs, local_shares, read_range, written_range

    if not model.partitioned:
        if any(t.is_meta for t in model.module.state_dict().values()):
            raise ValueError(
                "mpar.save_pretrained: the model is built on the meta device and has no "
                "values before its first step (or mpar.materialize)"
            )
        if model.grid.rank != 0:
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
            values = read_range(share, start, stop).to(model.state_keys.dtypes[key])
            out += [(key, a, run) for a, run in full_runs(share, model.grid.tp_rank, start, values)]
    return out
