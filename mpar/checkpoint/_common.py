"""What saving and loading share: the format name, the error type, agreement."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from mpar._compat import CheckpointException
from mpar.comm._checkpoint_comm import all_gather_object_in
from mpar.comm._types import ProcessGroup
from mpar.errors import MparError

__all__ = ["FORMAT", "CheckpointError", "agree", "check_model", "describe_failure"]

FORMAT = "mpar-dcp-v1"


class CheckpointError(MparError, ValueError):
    """A checkpoint is missing, incomplete, unreadable, or does not fit the model."""


def agree(error: str | None, group: ProcessGroup | None, what: str) -> None:
    """Every rank raises if any rank failed (its message), instead of hanging."""
    errors = [(r, e) for r, e in enumerate(all_gather_object_in(error, group)) if e]
    if errors:
        rank, text = errors[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {text}")


def check_model(model: object, optimizer: object) -> None:
    from mpar.runtime import DistributedModel, DistributedOptimizer

    if not isinstance(model, DistributedModel):
        raise TypeError(f"model must be an mpar.DistributedModel, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"optimizer must be an mpar.DistributedOptimizer or None, got {type(optimizer).__name__}"
        )


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: DCP's per-rank failures, causes and contexts."""
    out: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e in out:
            continue
        out.append(e)
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def describe_failure(exc: BaseException, where: Path) -> str:
    """A short cause of a failed DCP save or load (DCP's own text is a traceback per
    rank): a full disk with its free bytes, else each failing rank's first line."""
    causes = _causes(exc)
    full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes)
    short = any("unexpected pos" in str(c) for c in causes)  # torch's writer, cut short
    if full or short:
        try:
            free = f"{shutil.disk_usage(where).free} bytes free under {str(where)!r}"
        except OSError:
            free = f"under {str(where)!r}"
        if full:
            return f"no space left on device, {free}"
        return f"a file write was cut short (is the disk full? {free})"
    if isinstance(exc, CheckpointException):
        ranks = ", ".join(
            f"rank {r}: {_first_line(f[0] if isinstance(f, tuple) else f)}"
            for r, f in sorted(exc.failures.items())
        )
        return ranks or _first_line(exc)
    return _first_line(exc)
