"""What a flat bucket is, fixed when it is made: its parameters, its group, its storage.

A :class:`~mpar.shard._bucket.FlatBucket` and its
:class:`~mpar.shard._bucket_grads.BucketGrads` share one :class:`BucketLayout`; how the
bucket's gradients are reduced beyond the data-parallel sum is a
:class:`ReduceOptions`, decided by :class:`~mpar.shard.ShardedStages` before the
bucket is made.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mpar import _streams
from mpar.comm._types import ProcessGroup
from mpar.shard._flat_layout import BucketSpec, SlotSpec

__all__ = ["BucketLayout", "GroupInfo", "LayoutView", "ReduceOptions"]


@dataclass(frozen=True)
class GroupInfo:
    """The data-parallel group a stage is sharded over."""

    group: ProcessGroup | None
    ranks: tuple[int, ...]
    """Global ranks of the group, in group order."""
    rank: int
    """This process's position in ``ranks``."""

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class BucketLayout:
    """One bucket's parameters, where each sits in the flat buffer, the group it is
    sharded over, and how its tensors are stored (see :mod:`mpar.shard._bucket`)."""

    spec: BucketSpec
    params: tuple[nn.Parameter, ...]
    shapes: tuple[torch.Size, ...]
    zero_stage: int
    comm: GroupInfo
    device: torch.device
    dtype: torch.dtype
    """The dtype of parameters and gradients in compute (lower under mixed precision)."""
    master_dtype: torch.dtype
    """The parameters' original dtype: what the optimizer updates."""
    grad_dtype: torch.dtype
    """What gradients accumulate and are reduced in: ``master_dtype`` (fp32) unless a
    lower ``reduce_dtype`` was asked for. When it differs from ``dtype`` the
    parameters' ``.grad`` (compute dtype) are folded into an fp32 buffer after each
    backward instead of being views of it (see :meth:`BucketGrads.bind_grads`)."""
    offload_optimizer: bool
    """``master`` and the optimizer step on the CPU (also with ``offload_params``)."""
    offload_params: bool
    own: tuple[int, int]
    """``[lo, hi)``: this rank's slice of the padded buffer."""

    @functools.cached_property
    def slot_of(self) -> dict[int, SlotSpec]:
        """``id(param)`` -> its slot in the flat buffer."""
        return {id(p): slot for p, slot in zip(self.params, self.spec.slots)}

    @classmethod
    def make(
        cls,
        spec: BucketSpec,
        params: Sequence[nn.Parameter],
        *,
        zero_stage: int,
        comm: GroupInfo,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
    ) -> BucketLayout:
        master_dtype = params[0].dtype
        return cls(
            spec,
            tuple(params),
            tuple(p.shape for p in params),
            zero_stage,
            comm,
            device,
            compute_dtype or master_dtype,
            master_dtype,
            reduce_dtype or master_dtype,
            offload_optimizer or offload_params,
            offload_params,
            spec.shard_range(comm.rank),
        )

    @property
    def opt_range(self) -> tuple[int, int]:
        """Elements of the padded buffer this rank's optimizer updates."""
        return (0, self.spec.padded) if self.zero_stage == 0 else self.own


@dataclass(frozen=True)
class ReduceOptions:
    """How a bucket's gradients are reduced and counted, besides the sum over its group."""

    per_unit: bool = False
    """A unit bucket: gradients reduced after every backward of its unit (ZeRO 2 and 3
    with unit-granular gathering; see :mod:`mpar.shard._bucket`)."""
    tied_group: ProcessGroup | None = None
    """A tied parameter (the bucket's only one): the group of ranks holding its copies,
    over which its reduced gradient is summed."""
    tied_size: int = 1
    """Ranks in ``tied_group``."""
    norm_copies: int = 1
    """Ranks outside the data-parallel group holding the same gradients (a parameter
    replicated over tensor parallelism): the global norm counts it once."""


class LayoutView:
    """Read access to the :class:`BucketLayout` an object holds as ``layout``."""

    layout: BucketLayout

    @property
    def spec(self) -> BucketSpec:
        return self.layout.spec

    @property
    def params(self) -> tuple[nn.Parameter, ...]:
        return self.layout.params

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        return self.layout.shapes

    @property
    def zero_stage(self) -> int:
        return self.layout.zero_stage

    @property
    def comm(self) -> GroupInfo:
        return self.layout.comm

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return self.layout.master_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.layout.grad_dtype

    @property
    def streams(self) -> _streams.Streams:
        """The device seam's streams for this bucket's collectives and copies: side
        streams where the group's backend communicates the device's tensors in place
        (NCCL on CUDA), else the host's one stream (:mod:`mpar._streams`)."""
        return _streams.streams_for(self.device, _backend(self.comm))

    @property
    def folds_grads(self) -> bool:
        """Whether gradients accumulate in a dtype above the parameters' (bf16 / fp16
        parameters, fp32 gradient buffers): ``.grad`` cannot view them."""
        return self.layout.grad_dtype != self.layout.dtype

    @property
    def offload_optimizer(self) -> bool:
        return self.layout.offload_optimizer

    @property
    def offload_params(self) -> bool:
        return self.layout.offload_params

    @property
    def lo(self) -> int:
        return self.layout.own[0]

    @property
    def hi(self) -> int:
        return self.layout.own[1]

    @property
    def opt_range(self) -> tuple[int, int]:
        """Elements of the padded buffer this rank's optimizer updates."""
        return self.layout.opt_range


def _backend(comm: GroupInfo) -> str | None:
    """``comm``'s backend (None for a group of one: it never communicates)."""
    if comm.size == 1 or not dist.is_initialized():
        return None
    return str(dist.get_backend(comm.group))
