"""Tensor-parallel collectives as differentiable operators inside captured stage graphs.

mpar's pipeline stages are graphs captured with ``torch.export`` and run eagerly,
so the module hooks that torch's DTensor styles install have no module left to
fire on, and an autograd function's backward is lost in capture. The four
operators a tensor-parallel layer needs are therefore ``torch.library`` custom
operators with registered backward formulas (Megatron-LM's *f* and *g*, and the
gather / split pair). Capture keeps each as one node; running the stage runs
the operator and autograd uses its formula:

==================  ==============================  =============================
operator            forward                         backward
==================  ==============================  =============================
``tp_copy``         identity                        sum over the TP group
``tp_reduce``       sum over the TP group           identity
``tp_gather(d)``    concatenate the group's pieces  this rank's piece
                    along dim ``d``
``tp_split(d)``     this rank's piece along ``d``   concatenate along ``d``
==================  ==============================  =============================

The communication itself is DTensor's: a local tensor wrapped as a DTensor on the
TP mesh with the placement it has (``Partial`` for partial sums, ``Shard(d)`` for
pieces) is redistributed to ``Replicate``. Where the grid has no ``DeviceMesh``
(the MPI and XLA backends) the same collectives run on the TP process group.

Operators name their group by a key registered with :func:`register_tp_group`;
:func:`clear_tp_groups` (run by ``mpar.shutdown``) forgets them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from mpar._compat import DeviceMesh
from mpar.comm._types import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "TP_GROUP",
    "clear_tp_groups",
    "register_tp_group",
    "tp_copy",
    "tp_gather",
    "tp_reduce",
    "tp_split",
]


@dataclass(frozen=True)
class _TPGroup:
    group: ProcessGroup
    mesh: DeviceMesh | None
    size: int
    rank: int


_GROUPS: dict[str, _TPGroup] = {}

TP_GROUP = "tp"
"""The key of the grid's TP group (registered by ``mpar.init``)."""


def register_tp_group(
    key: str, group: ProcessGroup, mesh: DeviceMesh | None, size: int, rank: int
) -> str:
    """Make ``group`` (this rank at ``rank`` of ``size``) known to the operators as ``key``."""
    _GROUPS[key] = _TPGroup(group, mesh, size, rank)
    return key


def clear_tp_groups() -> None:
    _GROUPS.clear()


def _group(key: str) -> _TPGroup:
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(
            f"tensor-parallel group {key!r} is not registered in this process (a stage built "
            "for one mpar.init used after mpar.shutdown?)"
        ) from None


def _dtensor_replicate(x: torch.Tensor, g: _TPGroup, placement: Placement) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    assert g.mesh is not None
    dt = DTensor.from_local(x, g.mesh, [placement], run_check=False)
    return dt.redistribute(g.mesh, [Replicate()]).to_local()


def _sum(x: torch.Tensor, key: str) -> torch.Tensor:
    g = _group(key)
    if g.size == 1:
        return x.clone()
    if g.mesh is not None:
        from torch.distributed.tensor import Partial

        return _dtensor_replicate(x.contiguous(), g, Partial()).clone()
    out = x.contiguous().clone()
    dist.all_reduce(out, group=g.group)
    return out


def _concat(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    g = _group(key)
    if g.size == 1:
        return x.clone()
    dim = dim % x.dim()
    if g.mesh is not None:
        from torch.distributed.tensor import Shard

        return _dtensor_replicate(x.contiguous(), g, Shard(dim)).clone()
    pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(g.size)]
    dist.all_gather(pieces, x.contiguous(), group=g.group)
    return torch.cat(pieces, dim=dim)


def _piece(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    g = _group(key)
    return x.chunk(g.size, dim=dim)[g.rank].clone()


def _gathered_shape(x: torch.Tensor, dim: int, key: str) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] * _group(key).size
    return shape


def _split_shape(x: torch.Tensor, dim: int, key: str) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] // _group(key).size
    return shape


@torch.library.custom_op("mpar::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward, gradient summed over the TP group (Megatron's *f*)."""
    return x.clone()


@torch.library.custom_op("mpar::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the TP group forward, identity backward (Megatron's *g*)."""
    return _sum(x, group)


@torch.library.custom_op("mpar::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The TP group's pieces concatenated along ``dim``; backward: this rank's piece."""
    return _concat(x, dim, group)


@torch.library.custom_op("mpar::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim``; backward: the pieces concatenated."""
    return _piece(x, dim, group)


@tp_copy.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@tp_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@tp_gather.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return x.new_empty(_gathered_shape(x, dim % x.dim(), group))


@tp_split.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return x.new_empty(_split_shape(x, dim % x.dim(), group))


class _Ctx(Protocol):
    """What the backward formulas keep: the operator's arguments after the tensor."""

    args: tuple[object, ...]


Grads = tuple[torch.Tensor | None, ...]


def _setup(ctx: _Ctx, inputs: tuple[object, ...], output: object) -> None:
    ctx.args = inputs[1:]


def _copy_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    (group,) = ctx.args
    assert isinstance(group, str)
    return tp_reduce(grad, group), None


def _reduce_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    return grad, None


def _gather_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    dim, group = ctx.args
    assert isinstance(dim, int) and isinstance(group, str)
    return tp_split(grad, dim, group), None, None


def _split_backward(ctx: _Ctx, grad: torch.Tensor) -> Grads:
    dim, group = ctx.args
    assert isinstance(dim, int) and isinstance(group, str)
    return tp_gather(grad, dim, group), None, None


tp_copy.register_autograd(_copy_backward, setup_context=_setup)
tp_reduce.register_autograd(_reduce_backward, setup_context=_setup)
tp_gather.register_autograd(_gather_backward, setup_context=_setup)
tp_split.register_autograd(_split_backward, setup_context=_setup)
