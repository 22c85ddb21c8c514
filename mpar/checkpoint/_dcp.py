"""mpar's pieces of torch.distributed.checkpoint (DCP): sharded tensors, planners, I/O.

:class:`Pieces` is one tensor of the checkpoint (its full shape and dtype) of
which this rank holds some boxes, each a view of a flat shard (ZeRO's slice
of a bucket, or of optimizer state): DCP saves the boxes as chunks of that
tensor and, at load, reads whichever saved chunks overlap the boxes wanted, so
a checkpoint reloads into any layout. Pieces implement DCP's checkpointable
protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``); the planners below look them up.

:class:`BoundedWriter` starts a new file whenever the tensors of one file would
pass ``buffer_bytes``: DCP clones each view it writes and keeps the clones of a
file until the file is closed, so a rank never holds more than one such
buffer beside its shards. :class:`SafeReader` unpickles ``.metadata`` with an
allow-list of DCP's metadata classes, and :class:`SafeLoadPlanner` loads
non-tensor values with ``torch.load(weights_only=True)``: loading a checkpoint
cannot run code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from queue import Queue

import torch
from torch.futures import Future

from mpar._compat import (
    ChunkStorageMetadata,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    Metadata,
    MetadataIndex,
    ReadItem,
    SavePlan,
    SavePlanner,
    StorageMeta,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
    WriteResult,
    flatten_state_dict,
    set_element,
)
from mpar.checkpoint._boxes import Box, run_boxes
from mpar.tensor_parallel import TPShard

__all__ = [
    "BoundedWriter",
    "LocalSplit",
    "Pieces",
    "SafeLoadPlanner",
    "SafeReader",
    "SavePlannerWithPieces",
]

DEFAULT_SUFFIX = ".distcp"


@dataclass(frozen=True)
class LocalSplit:
    """This rank's tensor-parallel piece of a tensor of ``full_shape``, as ``shard`` cuts
    it (its ``dim`` in blocks, each cut ``shard.size`` ways; the piece is part ``rank``
    of every block)."""

    full_shape: torch.Size
    shard: TPShard
    rank: int

    @property
    def local_shape(self) -> torch.Size:
        return self.shard.local_shape(self.full_shape)

    def to_full(self, box: Box, view: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
        """A box of the piece (and its view) as boxes of the whole tensor."""
        d = self.shard.dim
        lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
        out = []
        while lo < hi:
            whole, run = self.shard.whole_index(self.full_shape[d], lo, self.rank)
            end = min(hi, lo + run)
            offsets, sizes = list(box.offsets), list(box.sizes)
            offsets[d], sizes[d] = whole, end - lo
            part = view.narrow(d, lo - box.offsets[d], end - lo)
            out.append((Box(tuple(offsets), tuple(sizes), box.flat_start), part))
            lo = end
        return out


class Pieces:
    """Boxes of one checkpoint tensor of ``shape`` and ``dtype`` held by this rank.

    ``add_run(flat, start, stop)``: ``flat`` (1-D) holds elements ``[start, stop)``
    of the flattened tensor; it is split into boxes whose views are written
    (save) or filled (load).
    """

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, split: LocalSplit | None = None
    ) -> None:
        self.split = split
        """Runs are of this rank's TP piece of the tensor (None: of the whole tensor)."""
        self.shape = torch.Size(shape) if split is None else split.full_shape
        self.dtype = dtype
        self.parts: list[tuple[Box, torch.Tensor]] = []
        self.local: torch.Tensor | None = None
        """Set by whoever made these pieces to stand for one whole local tensor."""

    def add_run(self, flat: torch.Tensor, start: int, stop: int) -> None:
        if flat.dim() != 1 or flat.numel() != stop - start:
            raise ValueError(
                f"a run [{start}, {stop}) needs a 1-D tensor of {stop - start} elements, "
                f"got shape {tuple(flat.shape)}"
            )
        shape = self.shape if self.split is None else self.split.local_shape
        for box in run_boxes(shape, start, stop):
            lo = box.flat_start - start
            view = flat[lo : lo + box.numel].view(box.sizes)
            if self.split is None:
                self.parts.append((box, view))
            else:
                self.parts += self.split.to_full(box, view)

    def size(self) -> torch.Size:
        return self.shape

    def part(self, offsets: Sequence[int] | None) -> torch.Tensor:
        """The view of the box at ``offsets``."""
        wanted = tuple(offsets or ())
        for box, view in self.parts:
            if box.offsets == wanted:
                return view
        raise KeyError(f"no box at offsets {wanted} in a piece of shape {tuple(self.shape)}")

    # -- DCP's checkpointable protocol ------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(box),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for box, _ in self.parts
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(box) for box, _ in self.parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.part(index.offset)


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


def _lookup(state_dict: dict[str, object], index: MetadataIndex) -> torch.Tensor | None:
    value = state_dict[index.fqn]
    if isinstance(value, Pieces):
        return value.part(index.offset)
    return None


class SavePlannerWithPieces(DefaultSavePlanner):
    """DCP's default save planner (flattening, deduplication of replicated
    entries), which also finds the boxes of :class:`Pieces`."""

    def lookup_object(self, index: MetadataIndex) -> object:
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with :class:`Pieces` destinations and
    ``weights_only`` loading of non-tensor values."""

    def set_up_planner(
        self,
        state_dict: dict[str, object],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # As DefaultLoadPlanner, without materialising meta tensors: that pass
        # replaces objects it does not know (Pieces) by None.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)


def _files(items: Sequence[WriteItem], buffer_bytes: int) -> Iterator[list[WriteItem]]:
    """``items`` grouped into files of at most ``buffer_bytes`` of tensors (a bigger
    tensor alone); non-tensor entries go into the first file."""
    current: list[WriteItem] = [i for i in items if i.type is WriteItemType.BYTE_IO]
    size = 0
    for item in items:
        if item.type is WriteItemType.BYTE_IO:
            continue
        nbytes = item.tensor_storage_size() or 0
        if current and size + nbytes > buffer_bytes:
            yield current
            current, size = [], 0
        current.append(item)
        size += nbytes
    if current:
        yield current


class BoundedWriter(FileSystemWriter):
    """DCP's file-system writer, with files of at most ``buffer_bytes`` of tensors."""

    def __init__(self, path: str, *, buffer_bytes: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.buffer_bytes = buffer_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        write = getattr(self, "_write_data", None)
        if write is None:  # another torch: its own file split
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        queue: Queue[tuple[object, str, list[WriteItem]]] = Queue()
        for n, items in enumerate(_files(plan.items, self.buffer_bytes)):
            name = f"{prefix}{n}{DEFAULT_SUFFIX}"
            queue.put((self.fs.concat_path(self.path, name), name, items))
        return write(planner, queue)


_ALLOWED = {
    ("torch", "Size"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "float32"),
    ("torch", "float64"),
    ("torch", "strided"),
    ("torch", "contiguous_format"),
    ("torch", "preserve_format"),
    ("torch", "channels_last"),
    ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),  # the checkpoint id
    ("pathlib", "WindowsPath"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
"""Its classes are plain dataclasses and enums: allowed."""


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        if module == _METADATA_MODULE:  # classes only: never a function to call
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint's "
            "metadata never holds; refusing to load it"
        )


class SafeReader(FileSystemReader):
    """DCP's file-system reader; ``.metadata`` is unpickled with an allow-list."""

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
