"""The torch internals mpar uses, in one place, for every torch it supports.

mpar supports torch 2.9 to 2.14 (``pyproject.toml``; CI runs 2.9.1 and 2.13.0, see
docs/devices.md). What mpar takes from torch's private or fast-moving modules --
``torch.fx``, ``torch.export``, ``torch.utils._pytree``, fake tensors, the FLOP
counter, ``torch.distributed.checkpoint`` (DCP), ``DeviceMesh`` (the rank grid's
groups), the elastic launcher's config and autograd's saved-tensor hooks -- is
imported here and nowhere else, and where releases differ the difference is bridged
here, by feature detection rather than version numbers. (mpar does not use DTensor.)

Differences bridged:

* ``TreeSpec.child(i)`` is new in torch 2.10; 2.9 has ``children_specs[i]``
  (:func:`spec_child`).
* autograd's ``_top_saved_tensors_default_hooks`` is absent from some builds
  (:func:`top_saved_tensors_hooks` answers ``None`` there).
* ``LaunchConfig(shutdown_timeout=...)`` is new in torch 2.10 (:func:`launch_config`
  leaves out what the installed torch does not take).

And one behaviour of every release: the fake mode of an exported program keeps weak
references to the real parameters it converted, and ``torch.utils.swap_tensors``
refuses a tensor that has any, so a traced model could not move to an XLA device
(:func:`export` forgets them).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.export import Dim, ExportedProgram, ShapesCollection
from torch.utils.flop_counter import FlopCounterMode

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "backend_options",
    "CheckpointException",
    "ChunkStorageMetadata",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "DeviceMesh",
    "Dim",
    "ExportedProgram",
    "FakeTensorMode",
    "FileSystemReader",
    "FileSystemWriter",
    "FlopCounterMode",
    "Metadata",
    "MetadataIndex",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "ShapesCollection",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "TensorWriteData",
    "WriteItem",
    "WriteItemType",
    "WriteResult",
    "dcp",
    "export",
    "flatten_state_dict",
    "fx",
    "launch_config",
    "pytree",
    "set_element",
    "spec_child",
    "top_saved_tensors_hooks",
]


def backend_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Process-group options of ``backend`` (gloo or nccl) carrying ``timeout``, for a
    ``DeviceMesh``'s ``backend_override`` (gloo's options class is private)."""
    if backend == "gloo":
        options: Any = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    else:
        options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def spec_child(spec: pytree.TreeSpec, index: int) -> pytree.TreeSpec:
    """The ``index``-th child of a pytree ``spec`` (``TreeSpec.child`` from torch 2.10,
    ``children_specs`` before)."""
    child = getattr(spec, "child", None)
    return child(index) if child is not None else spec.children_specs[index]


def top_saved_tensors_hooks() -> (
    tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor]] | None
):
    """The innermost ``saved_tensors_hooks`` pair active now, or ``None`` (none active,
    or a torch build without the accessor)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def export(
    module: torch.nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    **options: Any,  # torch.export.export's keywords, passed on
) -> ExportedProgram:
    """``torch.export.export``, then its fake mode forgets the real tensors it converted.

    The fake mode memoises each real tensor (weak references to ``module``'s
    parameters and buffers) for converting it again, which mpar never asks of it; left
    there, they make ``swap_tensors`` refuse those parameters when the stages move to
    an XLA device.
    """
    program = torch.export.export(module, args, kwargs, **options)
    modes = {id(m): m for m in _fake_modes(program)}
    for mode in modes.values():
        converter = getattr(mode, "fake_tensor_converter", None)
        describer = getattr(getattr(converter, "meta_converter", None), "describer", None)
        for owner, memo in (
            (converter, "tensor_memo"),
            (describer, "lookup_tensor"),
            (describer, "lookup_storage"),
        ):
            getattr(getattr(owner, memo, None), "clear", lambda: None)()
    return program


def _fake_modes(program: ExportedProgram) -> list[FakeTensorMode]:
    values = (node.meta.get("val") for node in program.graph.nodes)
    return [v.fake_mode for v in values if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")]


_NEWER_LAUNCH_FIELDS = {"shutdown_timeout"}
"""``LaunchConfig`` fields that older torch in the supported range lacks."""


def launch_config(**fields: Any) -> LaunchConfig:
    """torch's elastic ``LaunchConfig`` from ``fields``, leaving out a newer field the
    installed torch does not know (``shutdown_timeout`` before torch 2.10: its agent's
    default grace applies)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    drop = _NEWER_LAUNCH_FIELDS - known
    return LaunchConfig(**{k: v for k, v in fields.items() if k not in drop})
