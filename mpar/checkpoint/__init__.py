"""Checkpoints: ``mpar.save_checkpoint`` / ``mpar.load_checkpoint``.

A checkpoint is a torch.distributed.checkpoint (DCP) directory: every rank
writes only what it owns — the parameters of its pipeline stages, its ZeRO
slice of them (the fp32 master values, from the CPU when offloaded) and of the
optimizer state — and no rank gathers the model. Parameters keep the original
module's state-dict keys and optimizer state is keyed by parameter name, so a
checkpoint reloads into any layout (pipeline degree, virtual stages, data
parallelism, ZeRO stage, offload, mixed precision), into a model that is not
partitioned yet, and into plain PyTorch with ``torch.distributed.checkpoint``
(see ``docs/runtime.md``)::

    handle = mpar.save_checkpoint("ckpt", model, optimizer, user_content={"step": step})
    user = mpar.load_checkpoint("ckpt", model, optimizer)    # ckpt/latest

Each save writes a new ``ckpt/ckpt-NNNNNN`` directory through a temporary one
and commits it atomically (see :mod:`mpar.checkpoint._dirs`): an interrupted
save — a rank killed mid-write included — leaves ``latest`` on the previous
checkpoint, and an incomplete directory is never loaded. ``async_save=True``
returns once this rank's shards are copied to host memory; the files are
written and committed in a background thread while training continues
(``handle.wait()`` or :func:`wait_checkpoint` to block; the next save or load
and ``mpar.shutdown`` wait for it). Loading cannot run code: DCP's metadata is
unpickled with an allow-list and every other value with ``weights_only=True``,
so ``user_content`` must be made of tensors, numbers, strings, lists, tuples
and dicts. Single-file checkpoints of the earlier format still load.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element

from mpar.checkpoint import _dirs
from mpar.checkpoint._async import CheckpointHandle, finished, submit, wait_checkpoint
from mpar.checkpoint._dcp import (
    BoundedWriter,
    Pieces,
    SafeLoadPlanner,
    SafeReader,
    SavePlannerWithPieces,
)
from mpar.checkpoint._legacy import load_gathered
from mpar.checkpoint._state import (
    load_model_targets,
    load_optimizer_targets,
    merge_param_groups,
    model_entries,
    optimizer_entries,
    publish_masters,
)
from mpar.comm import state
from mpar.comm._bootstrap import on_shutdown
from mpar.comm._checkpoint_comm import (
    all_gather_object_in,
    broadcast_object_in,
    checkpoint_group,
)
from mpar.errors import MparError

__all__ = [
    "CheckpointError",
    "CheckpointHandle",
    "load_checkpoint",
    "save_checkpoint",
    "wait_checkpoint",
]

FORMAT = "mpar-dcp-v1"
WRITE_BUFFER_BYTES = 32 * 2**20
"""Tensor bytes per shard file: DCP keeps copies of one file's tensors until it is
written, so this bounds what a save holds beside the shards themselves."""


class CheckpointError(MparError, ValueError):
    """A checkpoint is missing, incomplete, unreadable, or does not fit the model."""


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _agree(error: str | None, group: Any, what: str) -> None:
    """Every rank raises if any rank failed (its message), instead of hanging."""
    errors = [(r, e) for r, e in enumerate(all_gather_object_in(error, group)) if e]
    if errors:
        rank, text = errors[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {text}")


def _check_model(model: Any, optimizer: Any) -> None:
    from mpar.runtime import DistributedModel, DistributedOptimizer

    if not isinstance(model, DistributedModel):
        raise TypeError(f"model must be an mpar.DistributedModel, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"optimizer must be an mpar.DistributedOptimizer or None, got {type(optimizer).__name__}"
        )


# ------------------------------------------------------------------------- save
def _prepare_root(root: Path, group: Any) -> tuple[Path, str]:
    """Rank 0 clears interrupted saves and makes the temporary directory (every rank
    learns its name, or the error)."""
    decision: Any = None
    if state().layout.rank == 0:
        try:
            if root.is_file():
                raise CheckpointError(
                    f"{str(root)!r} is a file (a single-file checkpoint?); checkpoints are "
                    "directories now: pass a directory path"
                )
            _dirs.remove_stale(root)
            decision = _dirs.new_tmp_dir(root)
        except (OSError, CheckpointError) as exc:
            decision = f"{type(exc).__name__}: {exc}"
    decision = broadcast_object_in(decision, group)
    if isinstance(decision, str):
        raise CheckpointError(f"cannot save checkpoint under {str(root)!r}: {decision}")
    return decision[0], decision[1]


def _entries(model: Any, optimizer: Any, user_content: Any, copy: Any) -> dict[str, Any]:
    entries: dict[str, Any] = {"model": model_entries(model, copy)}
    if optimizer is not None:
        if callable(getattr(optimizer, "_pending", None)):
            raise CheckpointError(
                "the optimizer state loaded from a checkpoint is applied at the first step; "
                "save after it"
            )
        entries["optim"] = optimizer_entries(optimizer, model, copy)
    if state().layout.rank == 0:
        extras = io.BytesIO()
        torch.save({"user_content": user_content, "loss_scaler": _scaler_state(optimizer)}, extras)
        entries["mpar"] = {"extras": extras.getvalue()}
    return entries


def _merge_groups(groups: list[dict[str, Any]], model: Any, group: Any) -> None:
    local = [g["params"] for g in groups]
    merged = merge_param_groups(local, all_gather_object_in(local, group), model._key_order)
    for g, names in zip(groups, merged):
        g["params"] = names


def _scaler_state(optimizer: Any) -> Any:
    sharded = None if optimizer is None else optimizer.sharded_optimizer()
    scaler = None if sharded is None else sharded.sharded.scaler
    return None if scaler is None else scaler.state_dict()


def _marker() -> dict[str, Any]:
    st = state()
    return {
        "format": FORMAT,
        "world_size": st.layout.world_size,
        "config": st.config.to_dict(),
        "torch": torch.__version__,
        "time": time.time(),
    }


def _write_and_commit(
    entries: dict[str, Any], tmp: Path, name: str, group: Any, keep_last: int | None
) -> Path:
    rank = state().layout.rank
    try:
        dcp.save(
            entries,
            storage_writer=BoundedWriter(str(tmp), buffer_bytes=WRITE_BUFFER_BYTES),
            planner=SavePlannerWithPieces(),
            process_group=group,
        )
    except Exception as exc:  # DCP raises on every rank when any rank failed
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"writing checkpoint {str(tmp.parent / name)!r} failed: {exc}; the previous "
            "checkpoint stays the latest"
        ) from None
    error = None
    if rank == 0:
        try:
            _dirs.commit(tmp, name, _marker(), keep_last)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    try:
        error = broadcast_object_in(error, group)
    except RuntimeError as exc:
        raise CheckpointError(
            f"lost contact with rank 0 while it committed {str(tmp.parent / name)!r} ({exc}); "
            f"'latest' names this checkpoint only if the commit finished"
        ) from None
    if error is not None:
        raise CheckpointError(
            f"committing checkpoint {str(tmp)!r} failed on rank 0: {error}; the previous "
            "checkpoint stays the latest"
        )
    return tmp.parent / name


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    user_content: Any = None,
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
    _check_model(model, optimizer)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    wait_checkpoint()
    on_shutdown(_wait_quietly)
    group = checkpoint_group()
    root = Path(path)
    tmp, name = _prepare_root(root, group)
    entries: dict[str, Any] = {}
    error = None
    try:
        entries = _entries(model, optimizer, user_content, _cpu_copy if async_save else _same)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, group, f"saving checkpoint under {str(root)!r}")
    if "optim" in entries:
        _merge_groups(entries["optim"]["param_groups"], model, group)

    def job() -> Path:
        return _write_and_commit(entries, tmp, name, group, keep_last)

    if async_save:
        return submit(job, root / name)
    return finished(job, root / name)


def _wait_quietly() -> None:
    """At shutdown: finish a pending save; report (not raise) its failure."""
    import warnings

    try:
        wait_checkpoint()
    except CheckpointError as exc:
        warnings.warn(f"the last asynchronous checkpoint failed: {exc}", stacklevel=2)


# ------------------------------------------------------------------------- load
def _resolve(path: Path, group: Any) -> tuple[str, Path]:
    decision: Any = None
    if state().layout.rank == 0:
        try:
            decision = _dirs.resolve(path)
            if decision[0] == "dcp":
                found = _dirs.read_marker(decision[1]).get("format")
                if found != FORMAT:
                    raise ValueError(f"{str(decision[1])!r} has format {found!r}, not {FORMAT!r}")
        except (OSError, ValueError) as exc:
            decision = str(exc)
    decision = broadcast_object_in(decision, group)
    if isinstance(decision, str):
        raise CheckpointError(decision)
    return decision[0], decision[1]


def _saved_shapes(metadata: Any) -> dict[tuple[str, ...], Any]:
    return {
        tuple(str(p) for p in path): metadata.state_dict_metadata[flat]
        for flat, path in (metadata.planner_data or {}).items()
    }


def _check_targets(targets: dict[str, Any], saved: dict[tuple[str, ...], Any], where: Path) -> None:
    missing = [k for k in targets if ("model", k) not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(where)!r} has no entries for {missing[:5]} "
            f"({len(missing)} missing): was it saved from another model?"
        )
    for key, target in targets.items():
        size = getattr(saved[("model", key)], "size", None)
        shape = target.shape if isinstance(target, Pieces | torch.Tensor) else None
        if size is not None and shape is not None and torch.Size(size) != shape:
            raise CheckpointError(
                f"checkpoint {str(where)!r} holds {key!r} with shape {tuple(size)}, the model "
                f"has {tuple(shape)}: it was saved from another model"
            )


def _group_placeholders(saved: dict[tuple[str, ...], Any]) -> list[Any]:
    holder: dict[str, Any] = {}
    for path, md in saved.items():
        if path[:2] == ("optim", "param_groups"):
            size = getattr(md, "size", None)
            value = None if size is None else torch.empty(size, dtype=md.properties.dtype)
            key_path = tuple(int(p) if p.isdigit() else p for p in path)
            set_element(holder, key_path, value)
    return list(holder.get("optim", {}).get("param_groups", []))


def _read(directory: Path, group: Any, sections: dict[str, Any]) -> None:
    try:
        dcp.load(
            sections,
            storage_reader=SafeReader(str(directory)),
            planner=SafeLoadPlanner(),
            process_group=group,
        )
    except Exception as exc:  # DCP raises on every rank when any rank failed
        raise CheckpointError(f"reading checkpoint {str(directory)!r} failed: {exc}") from None


def _extras(raw: Any) -> dict[str, Any]:
    return dict(torch.load(io.BytesIO(raw), weights_only=True))


def _optimizer_sections(
    optimizer: Any, model: Any, directory: Path, metadata: Any
) -> tuple[dict[str, Any], Any]:
    saved = _saved_shapes(metadata)
    if not any(path[0] == "optim" for path in saved):
        raise CheckpointError(f"checkpoint {str(directory)!r} holds no optimizer state")
    targets, install = load_optimizer_targets(optimizer, model, metadata)
    return {"state": targets, "param_groups": _group_placeholders(saved)}, install


def _load_optimizer(directory: Path, model: Any, optimizer: Any) -> None:
    """Read and install this rank's optimizer state (collective)."""
    group = checkpoint_group()
    error: str | None = None
    sections: dict[str, Any] = {}
    install: Any = None
    try:
        metadata = SafeReader(str(directory)).read_metadata()
        optim, install = _optimizer_sections(optimizer, model, directory, metadata)
        sections = {"optim": optim, "mpar": {"extras": None}}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, group, f"loading the optimizer state of {str(directory)!r}")
    _read(directory, group, sections)
    _install(install, sections, optimizer, directory, group)


def _install(
    install: Any, sections: dict[str, Any], optimizer: Any, where: Path, group: Any
) -> None:
    """Hand the optimizer its loaded state (every rank learns of any rank's failure)."""
    error = None
    try:
        install(sections["optim"])
        _load_scaler(optimizer, _extras(sections["mpar"]["extras"]))
    except (KeyError, ValueError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, group, f"loading the optimizer state of {str(where)!r}")


def _load_scaler(optimizer: Any, extras: dict[str, Any]) -> None:
    sharded = optimizer.sharded_optimizer()
    scaler = None if sharded is None else sharded.sharded.scaler
    if scaler is not None and extras.get("loss_scaler") is not None:
        scaler.load_state_dict(extras["loss_scaler"])


def load_checkpoint(path: str | os.PathLike[str], model: Any, optimizer: Any = None) -> Any:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns its ``user_content``.

    ``path`` is a checkpoint root (its ``latest`` is loaded), one checkpoint
    directory, or a single-file checkpoint of the earlier format. Collective;
    works before or after the model is partitioned and in any layout (before,
    the optimizer state is read at the first step).
    """
    _check_model(model, optimizer)
    wait_checkpoint()
    group = checkpoint_group()
    kind, directory = _resolve(Path(path), group)
    if kind == "file":
        try:
            return load_gathered(directory, model, optimizer)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None
    error: str | None = None
    sections: dict[str, Any] = {}
    install: Any = None
    try:
        metadata = SafeReader(str(directory)).read_metadata()
        targets = load_model_targets(model)
        _check_targets(targets, _saved_shapes(metadata), directory)
        sections = {"model": targets, "mpar": {"extras": None}}
        if optimizer is not None and model.partitioned:
            sections["optim"], install = _optimizer_sections(optimizer, model, directory, metadata)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, group, f"loading checkpoint {str(directory)!r}")
    _read(directory, group, sections)
    publish_masters(model)
    extras = _extras(sections["mpar"]["extras"])
    if install is not None:
        _install(install, sections, optimizer, directory, group)
    elif optimizer is not None:
        optimizer.defer_load(lambda: _load_optimizer(directory, model, optimizer))
    return extras.get("user_content")
