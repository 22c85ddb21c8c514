"""Hugging Face safetensors checkpoints, read and written by element range.

Reading: :class:`Checkpoint` opens ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` and returns any range of a tensor's elements
(row-major) through ``safe_open(...).get_slice``: only the rows that hold the
range are read (memory-mapped), never the whole tensor.

Writing: :func:`plan_files` lays the tensors out in files of at most
``max_shard_size`` bytes, the same on every rank (pure: names, shapes, dtypes);
:func:`create_files` writes each file's header and sizes it; then any rank
writes any byte range of a tensor with :func:`write_range` (``os.pwrite``), so
the ranks of a job each write what they hold, with no gathering.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "INDEX",
    "SINGLE",
    "Checkpoint",
    "FileLayout",
    "create_files",
    "parse_size",
    "plan_files",
    "write_index",
    "write_range",
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
    """A Hugging Face safetensors checkpoint directory (or one ``.safetensors`` file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        if root.is_file():
            files = {None: root}
            root = root.parent
        elif (root / INDEX).is_file():
            index = json.loads((root / INDEX).read_text())
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{root / INDEX} has no 'weight_map' object")
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
        self._handles: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        for key, file in files.items():
            if key is None:
                for name in self._open(file).keys():  # noqa: SIM118 (safe_open is no dict)
                    self.file_of[name] = file
            else:
                self.file_of[key] = file
        self.shapes: dict[str, torch.Size] = {}
        self.dtypes: dict[str, str] = {}
        for key, file in self.file_of.items():
            info = self._open(file).get_slice(key)
            self.shapes[key] = torch.Size(info.get_shape())
            self.dtypes[key] = info.get_dtype()

    def _open(self, file: Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint shard {file} (named by {INDEX}) is missing")
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key`` (row-major), read row by row."""
        shape = self.shapes[key]
        handle = self._open(self.file_of[key])
        if len(shape) == 0:
            return handle.get_tensor(key).reshape(-1)[start:stop]
        row = shape[1:].numel()
        if row == 0 or start >= stop:
            return torch.empty(0, dtype=handle.get_slice(key)[0:0].dtype)
        first, last = start // row, -(-stop // row)
        rows = handle.get_slice(key)[first:last]
        return rows.reshape(-1)[start - first * row : stop - first * row]

    def read_piece(self, key: str, dim: int, pieces: list[tuple[int, int]]) -> torch.Tensor:
        """The blocks ``(offset, length)`` along ``dim`` of tensor ``key``, concatenated
        (a tensor-parallel piece), read block by block."""
        handle = self._open(self.file_of[key])
        ndim = len(self.shapes[key])
        blocks = []
        for offset, length in pieces:
            index = tuple(
                slice(offset, offset + length) if d == dim else slice(None) for d in range(ndim)
            )
            blocks.append(handle.get_slice(key)[index])
        return torch.cat(blocks, dim)

    def close(self) -> None:
        self._handles.clear()


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
    """Write every file's header and give it its final size (data still zero)."""
    root.mkdir(parents=True, exist_ok=True)
    for layout in files:
        with open(root / layout.name, "wb") as f:
            f.write(layout.header)
            f.truncate(layout.size)


def write_range(root: Path, layout: FileLayout, key: str, start: int, values: torch.Tensor) -> None:
    """Write ``values`` (1-D, the saved dtype) as elements ``start...`` of ``key``."""
    data = values.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    offset = layout.offsets[key] + start * values.element_size()
    fd = os.open(root / layout.name, os.O_WRONLY)
    try:
        view = data.data.cast("B")
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    finally:
        os.close(fd)


def write_index(root: Path, files: Sequence[FileLayout]) -> None:
    """``model.safetensors.index.json`` for several files (nothing for one)."""
    if len(files) == 1:
        return
    weight_map = {key: layout.name for layout in files for key in layout.offsets}
    total = 0
    for layout in files:
        total += layout.size - len(layout.header)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
