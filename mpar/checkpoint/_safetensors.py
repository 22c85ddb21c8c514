"""Hugging Face safetensors checkpoints, read and written by element range.

Reading: :class:`Checkpoint` opens ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` and returns any range of a tensor's elements
(row-major): exactly their bytes are read (``os.preadv``), never the whole
tensor, and nothing is memory-mapped, so a rank's resident memory holds only
the elements it keeps. A folder that ``save_pretrained`` never committed, or
whose files its marker lists are missing or short, is refused
(:func:`mpar.checkpoint._hf_dirs.check_committed`).

Writing: :func:`plan_files` lays the tensors out in files of at most
``max_shard_size`` bytes, the same on every rank (pure: names, shapes, dtypes);
:func:`create_files` writes each file's header and reserves its size on disk;
then any rank writes byte ranges of a file with :func:`write_ranges`
(``os.pwrite``, flushed to disk and read back), so the ranks of a job each
write what they hold, with no gathering.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mpar.checkpoint._common import CheckpointError
from mpar.checkpoint._dirs import write_file
from mpar.checkpoint._hf_dirs import check_committed

__all__ = [
    "INDEX",
    "SINGLE",
    "Checkpoint",
    "FileLayout",
    "create_files",
    "parse_size",
    "plan_files",
    "write_index",
    "write_ranges",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}
for _name, _attr in [("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")]:  # fmt: skip
    if hasattr(torch, _attr):
        _FROM_NAME[_name] = getattr(torch, _attr)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` or ``"200MiB"`` (as Hugging Face)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number) :]
        if number and unit in _UNITS:
            try:
                value = float(number) * _UNITS[unit]
            except ValueError:
                value = 0
            if value >= 1:
                return int(value)
    raise ValueError(
        f"max_shard_size must be a positive number of bytes or a size such as '5GB' or "
        f"'200MiB', got {size!r}"
    )


# ---------------------------------------------------------------------------- reading


class Checkpoint:
    """A Hugging Face safetensors checkpoint directory (or one ``.safetensors`` file).

    Only the headers are read when it opens; :meth:`read` then reads the bytes of
    the elements asked for with ``os.preadv`` into memory of the caller's own.
    Nothing is memory-mapped: the file's pages are never counted in the process's
    resident set, and a rank's memory holds only what it keeps.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        files: dict[str | None, Path]
        if not root.is_file():
            check_committed(root)
        if root.is_file():
            files = {None: root}
            root = root.parent
        elif (root / INDEX).is_file():
            weight_map = _weight_map(root / INDEX)
            files = {k: root / v for k, v in weight_map.items()}
        elif (root / SINGLE).is_file():
            files = {None: root / SINGLE}
        else:
            raise FileNotFoundError(
                f"{root} holds neither {SINGLE} nor {INDEX}: not a Hugging Face safetensors "
                "checkpoint (save one with mpar.save_pretrained or transformers' "
                "save_pretrained(..., safe_serialization=True))"
            )
        self.root = root
        self._headers: dict[Path, dict[str, _Entry]] = {}
        self.file_of: dict[str, Path] = {}
        for key, file in files.items():
            if key is None:
                for name in self._header(file):
                    self.file_of[name] = file
            else:
                self.file_of[key] = file
        self.shapes: dict[str, torch.Size] = {}
        self.dtypes: dict[str, str] = {}
        for key, file in self.file_of.items():
            entry = self._header(file).get(key)
            if entry is None:
                raise ValueError(f"{file} has no tensor {key!r} ({INDEX} says it has)")
            self.shapes[key] = entry.shape
            self.dtypes[key] = entry.name

    def _header(self, file: Path) -> dict[str, _Entry]:
        if file not in self._headers:
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint shard {file} (named by {INDEX}) is missing")
            self._headers[file] = _read_header(file)
        return self._headers[file]

    def dtype(self, key: str) -> torch.dtype:
        """The dtype tensor ``key`` is stored in."""
        return self._header(self.file_of[key])[key].dtype

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key`` (row-major), 1-D, in the file's
        dtype: exactly their bytes are read."""
        file = self.file_of[key]
        entry = self._header(file)[key]
        count = max(stop - start, 0)
        out = torch.empty(count, dtype=entry.dtype)
        if count == 0:
            return out
        view = out.view(torch.uint8).numpy().data.cast("B")
        offset = entry.offset + start * entry.dtype.itemsize
        fd = os.open(file, os.O_RDONLY)
        try:
            while view:
                got = os.preadv(fd, [view], offset)
                if got <= 0:
                    raise ValueError(f"{file} ends inside tensor {key!r}: the file is truncated")
                view, offset = view[got:], offset + got
        finally:
            os.close(fd)
        return out

    def read_piece(self, key: str, dim: int, pieces: list[tuple[int, int]]) -> torch.Tensor:
        """The blocks ``(offset, length)`` along ``dim`` of tensor ``key``, concatenated
        (a tensor-parallel piece): only their bytes are read, one run per block and
        index of the dimensions before ``dim``."""
        shape = self.shapes[key]
        outer, inner = shape[:dim].numel(), shape[dim + 1 :].numel()
        runs = []
        for o in range(outer):
            for offset, length in pieces:
                start = (o * shape[dim] + offset) * inner
                runs.append(self.read(key, start, start + length * inner))
        local = list(shape)
        local[dim] = sum(length for _, length in pieces)
        return torch.cat(runs).reshape(local)

    def close(self) -> None:
        self._headers.clear()


def _weight_map(path: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file; CheckpointError naming the file and what is
    wrong."""
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
            "the index is corrupt or was cut short; save the checkpoint again"
        ) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not a text (JSON) file: the index is corrupt") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path} has no 'weight_map' object of tensor name -> file name")
    return weight_map


@dataclass
class _Entry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    """The safetensors dtype name (``"F32"``, ``"BF16"``, ...)."""
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    """Absolute byte offset of its first element in the file."""


def _read_header(file: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file, from its header."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if length > size - 8:
            raise ValueError(f"{file} is not a safetensors file (header length {length})")
        try:
            meta = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{file} is not a safetensors file (header: {e})") from None
    base = 8 + length
    out: dict[str, _Entry] = {}
    for key, info in meta.items():
        if key == "__metadata__":
            continue
        dtype = _FROM_NAME.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(
                f"{file}: tensor {key!r} has dtype {info.get('dtype')!r}, which torch cannot hold"
            )
        shape = torch.Size(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != shape.numel() * dtype.itemsize or base + end > size:
            raise ValueError(
                f"{file}: tensor {key!r} of shape {tuple(shape)} ({info['dtype']}) has data "
                f"offsets {begin}..{end}, which do not fit it or the file: the file is corrupt"
            )
        out[key] = _Entry(info["dtype"], dtype, shape, base + begin)
    return out


# ---------------------------------------------------------------------------- writing


@dataclass
class FileLayout:
    """One output file: its tensors' byte offsets after the header."""

    name: str
    header: bytes
    offsets: dict[str, int] = field(default_factory=dict)
    """Tensor -> absolute byte offset of its data in the file."""
    size: int = 0


def plan_files(
    tensors: Sequence[tuple[str, torch.Size, torch.dtype]], max_shard_size: int
) -> list[FileLayout]:
    """Tensors (in order) packed greedily into files of at most ``max_shard_size``
    bytes of data (a larger tensor gets a file to itself), named as Hugging Face does."""
    groups: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    used = 0
    for key, shape, dtype in tensors:
        if dtype not in _DTYPES:
            raise ValueError(f"{key}: dtype {dtype} cannot be saved in safetensors")
        nbytes = shape.numel() * dtype.itemsize
        if groups[-1] and used + nbytes > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append((key, shape, dtype))
        used += nbytes
    count = len(groups)
    out = []
    for i, group in enumerate(groups):
        name = SINGLE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        out.append(_layout(name, group))
    return out


def _layout(name: str, group: Sequence[tuple[str, torch.Size, torch.dtype]]) -> FileLayout:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for key, shape, dtype in group:
        nbytes = shape.numel() * dtype.itemsize
        meta[key] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    header = struct.pack("<Q", len(text)) + text
    layout = FileLayout(name, header, size=len(header) + position)
    for key, _shape, _dtype in group:
        layout.offsets[key] = len(header) + meta[key]["data_offsets"][0]
    return layout


def create_files(root: Path, files: Sequence[FileLayout]) -> None:
    """Write every file's header and reserve its final size on disk (data still zero):
    a disk without room fails here, before any rank writes (OSError ENOSPC)."""
    root.mkdir(parents=True, exist_ok=True)
    for layout in files:
        fd = os.open(root / layout.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, memoryview(layout.header), 0)
            os.ftruncate(fd, layout.size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, layout.size)
        finally:
            os.close(fd)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        view, offset = view[written:], offset + written


_CHECK_BYTES = 16 << 20


def _read_back(fd: int, view: memoryview, offset: int) -> bool:
    """Whether the file holds ``view`` at ``offset`` (compared in bounded pieces)."""
    for at in range(0, len(view), _CHECK_BYTES):
        piece = view[at : at + _CHECK_BYTES]
        if os.pread(fd, len(piece), offset + at) != piece:
            return False
    return True


def _bytes_at(
    layout: FileLayout, key: str, start: int, values: torch.Tensor
) -> tuple[memoryview, int]:
    """The host bytes of ``values`` (elements ``start...`` of ``key``) and their offset."""
    data = values.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    return data.data.cast("B"), layout.offsets[key] + start * values.element_size()


def write_ranges(
    root: Path, layout: FileLayout, items: Sequence[tuple[str, int, torch.Tensor]]
) -> None:
    """Write each ``(key, first element, values)`` (1-D, the saved dtype) into the file
    of ``layout``, flush it to disk, and read every range back: CheckpointError naming
    the file when one does not hold what was written."""
    path = root / layout.name
    fd = os.open(path, os.O_RDWR)
    try:
        for key, start, values in items:
            _write_all(fd, *_bytes_at(layout, key, start, values))
        os.fsync(fd)
        for key, start, values in items:  # (host bytes made again: one piece held at a time)
            if not _read_back(fd, *_bytes_at(layout, key, start, values)):
                raise CheckpointError(
                    f"{path}: the bytes of {key!r} read back differ from those written: the "
                    "file system lost a write"
                )
    finally:
        os.close(fd)


def write_index(root: Path, files: Sequence[FileLayout]) -> None:
    """``model.safetensors.index.json`` for several files (nothing for one), on disk."""
    if len(files) == 1:
        return
    weight_map = {key: layout.name for layout in files for key in layout.offsets}
    total = 0
    for layout in files:
        total += layout.size - len(layout.header)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_file(root / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
