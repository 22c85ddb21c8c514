"""Is every file of a checkpoint directory there, in full? Checked before a commit
and before a load.

DCP's ``.metadata`` records, for every saved chunk, the file it is in and its
byte range (``storage_data``). A checkpoint is whole when the metadata can be
read and every file it names exists and is at least as long as the end of the
last range in it. This catches a deleted or truncated shard, a corrupt
``.metadata``, and a save whose files another job removed, naming the file —
before DCP starts reading (which would fail late, deep in a traceback, or not
at all for a truncated shard until the optimizer steps).
"""

from __future__ import annotations

from pathlib import Path

from mpar._compat import Metadata
from mpar.checkpoint._common import CheckpointError
from mpar.checkpoint._dcp import SafeReader

__all__ = ["check_files", "read_metadata"]


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of ``directory``; CheckpointError naming the file if it is
    missing or unreadable."""
    path = directory / ".metadata"
    try:
        return SafeReader(str(directory)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint metadata {str(path)!r} is missing") from None
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint metadata {str(path)!r} is unreadable (corrupt or truncated: "
            f"{type(exc).__name__}: {exc}); load an earlier checkpoint"
        ) from None


def _needed_bytes(metadata: Metadata) -> dict[str, int]:
    """File name -> bytes it must hold (the end of its last recorded range)."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    return needed


def check_files(directory: Path) -> Metadata:
    """Raise CheckpointError naming the first missing or short file of the
    checkpoint in ``directory``; returns its metadata."""
    metadata = read_metadata(directory)
    needed = _needed_bytes(metadata)
    if not needed:
        raise CheckpointError(
            f"checkpoint metadata {str(directory / '.metadata')!r} names no data files: "
            "it is corrupt; load an earlier checkpoint"
        )
    for name, size in sorted(needed.items()):
        path = directory / name
        try:
            found = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is missing ({len(needed)} files recorded in "
                "its .metadata): the checkpoint is incomplete; load an earlier one"
            ) from None
        if found < size:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is truncated: {found} bytes, its .metadata "
                f"records {size}; the checkpoint is corrupt, load an earlier one"
            )
    return metadata
