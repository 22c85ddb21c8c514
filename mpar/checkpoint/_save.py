"""``save_checkpoint``: collect this rank's pieces, write them with DCP, commit.

The steps, on every rank: rank 0 takes the root's save lock (refused while
another live job saves there), clears interrupted saves and makes the
temporary directory (its name broadcast); each rank collects what it owns
(:mod:`mpar.checkpoint._state`; for an asynchronous save, copied to host
memory); the ranks agree that all of them succeeded; DCP writes the shards and
rank 0 the ``.metadata``; rank 0 checks that every file the metadata names is
there in full, commits (:func:`mpar.checkpoint._dirs.commit`)
and tells the others how it went. The last steps run in the checkpoint
thread for an asynchronous save. A failed save removes its temporary
directory, lets go of the lock and raises :class:`CheckpointError` naming the
cause (a full disk with its free bytes, the failing rank's error).
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path

import torch

from mpar._compat import CheckpointException, dcp
from mpar.checkpoint import _dirs
from mpar.checkpoint._async import CheckpointHandle, finished, submit, wait_checkpoint
from mpar.checkpoint._common import FORMAT, CheckpointError, agree, check_model, describe_failure
from mpar.checkpoint._dcp import BoundedWriter, SavePlannerWithPieces
from mpar.checkpoint._owner import Owner, RootLock
from mpar.checkpoint._state import (
    Copy,
    Groups,
    Sections,
    merge_param_groups,
    model_entries,
    optimizer_entries,
)
from mpar.checkpoint._verify import check_files
from mpar.comm._checkpoint_comm import (
    all_gather_object_in,
    broadcast_object_in,
    checkpoint_group,
)
from mpar.comm._types import ProcessGroup
from mpar.errors import MparError
from mpar.runtime import DistributedModel, DistributedOptimizer

__all__ = ["WRITE_BUFFER_BYTES", "PendingSave", "save_checkpoint"]

WRITE_BUFFER_BYTES = 32 * 2**20
"""Tensor bytes per shard file: DCP keeps copies of one file's tensors until it is
written, so this bounds what a save holds beside the shards themselves."""


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


class PendingSave:
    """Where one save writes: its temporary directory, the final name beside it, and
    (on rank 0) the lock, held until the save commits or fails. ``save_checkpoint``
    and ``save_pretrained`` both write through one."""

    def __init__(self, tmp: Path, name: str, lock: RootLock | None) -> None:
        self.tmp, self.name, self.lock = tmp, name, lock

    @property
    def final(self) -> Path:
        return self.tmp.parent / self.name

    def abandon(self) -> None:
        """Rank 0 removes the temporary directory and lets go of the lock."""
        if self.lock is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _claim_root(root: Path) -> tuple[tuple[Path, str], RootLock]:
    """Rank 0: take the root's lock, clear interrupted saves, make the temporary
    directory."""
    if root.is_file():
        raise CheckpointError(
            f"{str(root)!r} is a file (a single-file checkpoint?); checkpoints are "
            "directories now: pass a directory path"
        )
    owner = Owner.here()
    lock = RootLock(root, owner)
    try:
        _dirs.remove_stale(root)
        return _dirs.new_tmp_dir(root, owner), lock
    except BaseException:
        lock.release()
        raise


def _prepare_root(root: Path, group: ProcessGroup | None, rank: int) -> PendingSave:
    """Rank 0 claims the root (every rank learns the temporary directory's name,
    or the error)."""
    decision: tuple[Path, str] | str | None = None
    lock = None
    if rank == 0:
        try:
            decision, lock = _claim_root(root)
        except (OSError, MparError) as exc:
            decision = f"{type(exc).__name__}: {exc}"
    decision = broadcast_object_in(decision, group)
    if not isinstance(decision, tuple):
        raise CheckpointError(f"cannot save checkpoint under {str(root)!r}: {decision}")
    return PendingSave(decision[0], decision[1], lock)


def _entries(
    model: DistributedModel,
    optimizer: DistributedOptimizer | None,
    user_content: object,
    copy: Copy,
) -> Sections:
    entries: Sections = {"model": model_entries(model, copy)}
    if optimizer is not None:
        if optimizer.load_deferred:
            raise CheckpointError(
                "the optimizer state loaded from a checkpoint is read at the first step "
                "(when the model is partitioned); save after it"
            )
        entries["optim"] = optimizer_entries(optimizer, model, copy)
    if model.grid.rank == 0:
        extras = io.BytesIO()
        torch.save({"user_content": user_content, "loss_scaler": _scaler_state(optimizer)}, extras)
        _check_loadable(extras.getvalue())
        entries["mpar"] = {"extras": extras.getvalue()}
    return entries


def _check_loadable(raw: bytes) -> None:
    """Refuse now what a load could not read back (loads use ``weights_only``)."""
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            "user_content must load with torch.load(weights_only=True): use tensors, "
            f"numbers, strings, lists, tuples and dicts ({str(exc).splitlines()[0]})"
        ) from None


def _merge_groups(groups: Groups, model: DistributedModel, group: ProcessGroup | None) -> None:
    local = [[str(name) for name in _names(g)] for g in groups]
    every: list[list[list[str]] | None] = list(all_gather_object_in(local, group))
    merged = merge_param_groups(local, every, model.state_keys.order)
    for g, names in zip(groups, merged):
        g["params"] = names


def _names(group: dict[str, object]) -> list[object]:
    params = group["params"]
    assert isinstance(params, list)
    return params


def _scaler_state(optimizer: DistributedOptimizer | None) -> dict[str, float] | None:
    sharded = None if optimizer is None else optimizer.sharded_optimizer()
    scaler = None if sharded is None else sharded.sharded.scaler
    return None if scaler is None else scaler.state_dict()


def _marker(model: DistributedModel) -> dict[str, object]:
    return {
        "format": FORMAT,
        "world_size": model.grid.world_size,
        "config": model.config.to_dict(),
        "torch": torch.__version__,
        "time": time.time(),
    }


def _write(entries: Sections, save: PendingSave, group: ProcessGroup | None) -> None:
    try:
        dcp.save(
            entries,
            storage_writer=BoundedWriter(str(save.tmp), buffer_bytes=WRITE_BUFFER_BYTES),
            planner=SavePlannerWithPieces(),
            process_group=group,
        )
    except (Exception, CheckpointException) as exc:  # on every rank when any rank failed
        cause = describe_failure(exc, save.tmp.parent)
        save.abandon()
        raise CheckpointError(
            f"writing checkpoint {str(save.final)!r} failed: {cause}; the previous "
            "checkpoint stays the latest"
        ) from None


def _commit(save: PendingSave, keep_last: int | None, model: DistributedModel) -> str | None:
    """Rank 0: check every file, then commit; the error text, or None."""
    try:
        check_files(save.tmp)
        _dirs.commit(save.tmp, save.name, _marker(model), keep_last)
    except (OSError, CheckpointError) as exc:
        save.abandon()
        return f"{type(exc).__name__}: {exc}"
    finally:
        save.release()
    return None


def _write_and_commit(
    entries: Sections,
    save: PendingSave,
    group: ProcessGroup | None,
    keep_last: int | None,
    model: DistributedModel,
) -> Path:
    _write(entries, save, group)
    error = _commit(save, keep_last, model) if model.grid.rank == 0 else None
    try:
        error = broadcast_object_in(error, group)
    except RuntimeError as exc:
        raise CheckpointError(
            f"lost contact with rank 0 while it committed {str(save.final)!r} ({exc}); "
            f"'latest' names this checkpoint only if the commit finished"
        ) from None
    if error is not None:
        raise CheckpointError(
            f"committing checkpoint {str(save.final)!r} failed on rank 0: {error}; the "
            "previous checkpoint stays the latest"
        )
    return save.final


def save_checkpoint(
    path: str | os.PathLike[str],
    model: DistributedModel,
    optimizer: DistributedOptimizer | None = None,
    user_content: object = None,
    *,
    async_save: bool = False,
    keep_last: int | None = None,
) -> CheckpointHandle:
    """Save ``model``, ``optimizer`` and ``user_content`` as a new checkpoint under the
    directory ``path``; returns a :class:`CheckpointHandle`.

    Collective: every rank calls it. ``async_save=True`` returns once this rank's
    shards are copied to host memory (writing continues in the background);
    ``keep_last=k`` deletes all but the ``k`` newest complete checkpoints after
    this one is committed. ``user_content`` is taken from global rank 0.
    """
    check_model(model, optimizer)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    wait_checkpoint()
    group = checkpoint_group(model.grid)
    root = Path(path)
    save = _prepare_root(root, group, model.grid.rank)
    entries: Sections = {}
    error = None
    try:
        entries = _entries(model, optimizer, user_content, _cpu_copy if async_save else _same)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    try:
        agree(error, group, f"saving checkpoint under {str(root)!r}")
        if "optim" in entries:
            _merge_groups(entries["optim"]["param_groups"], model, group)
    except BaseException:
        save.abandon()
        raise

    def job() -> Path:
        try:
            return _write_and_commit(entries, save, group, keep_last, model)
        finally:
            save.release()

    if async_save:
        return submit(job, save.final)
    return finished(job, save.final)
