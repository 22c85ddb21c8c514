"""``ShardedOptimizer``: the user's optimizer rebuilt over this rank's flat shards."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpar import _device
from mpar.shard._bucket import FlatBucket
from mpar.shard._flat_layout import Segment, segments_of
from mpar.shard._state_dict import SHARDED_FORMAT, gather_full_state, split_full_state

if TYPE_CHECKING:
    from mpar.shard._sharded_stages import ShardedStages

__all__ = ["ShardedOptimizer"]


@dataclass(frozen=True)
class ParamRun:
    """Elements ``[start, stop)`` of one (flattened) parameter, held at ``offset`` in a
    flat optimizer parameter."""

    param: nn.Parameter
    shape: torch.Size
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class SegmentParam:
    """One flat optimizer parameter: a segment of a bucket's ``master``."""

    bucket: FlatBucket
    bucket_index: int
    segment: Segment
    param: nn.Parameter
    runs: tuple[ParamRun, ...]
    """The parameters whose elements it holds, in order."""

    def slice(self, tensor: torch.Tensor) -> torch.Tensor:
        lo = self.bucket.opt_range[0]
        return tensor[self.segment.lo - lo : self.segment.hi - lo]


def _runs(bucket: FlatBucket, segment: Segment) -> tuple[ParamRun, ...]:
    position = {slot.index: k for k, slot in enumerate(bucket.spec.slots)}
    out, offset = [], 0
    for piece in segment.pieces:
        k = position[piece.index]
        out.append(ParamRun(bucket.params[k], bucket.shapes[k], piece.start, piece.stop, offset))
        offset += piece.stop - piece.start
    return tuple(out)


_HOST_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""Optimizers with a fused CPU kernel (one vectorised, multi-threaded pass over each
flat shard instead of one pass per elementwise operation)."""


def fuses_on_host(optimizer: torch.optim.Optimizer, sharded: ShardedStages) -> bool:
    """Whether the rebuilt optimizer steps with the fused CPU kernel: its state is
    offloaded from an accelerator to the host, its class has one, and the user chose
    neither ``fused``, ``foreach``, ``differentiable`` nor ``capturable``. The update is
    the same arithmetic; on the host the fused kernel is about 5x faster (a 50M-element
    AdamW step: 0.13 s against 0.73 s on two cores), and the host step is what limits
    an offloaded step's speed (docs/devices.md)."""
    options = optimizer.defaults
    chosen = any(options.get(k) is not None for k in ("fused", "foreach")) or any(
        options.get(k) for k in ("differentiable", "capturable")
    )
    on_host = all(_device.on_host(b.master) for b in sharded.buckets)
    return (
        type(optimizer) in _HOST_FUSED
        and not chosen
        and on_host
        and not _device.is_host(sharded.device)
        and bool(sharded.buckets)
    )


def _rebuild(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], fused: bool = False
) -> torch.optim.Optimizer:
    """``type(optimizer)`` over ``groups``, with the constructor arguments it accepts
    (and ``fused=True`` when ``fused``: see :func:`fuses_on_host`)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    if fused:
        kwargs["fused"] = True
        groups = [{**g, "fused": True} for g in groups]
    return cls(groups, **kwargs)


class ShardedOptimizer:
    """The user's optimizer class over flat fp32 shard parameters (see :mod:`mpar.shard`).

    ``param_groups`` are the rebuilt optimizer's groups, one for each of the
    original optimizer's groups in the same order, so learning-rate
    schedulers work on this object as on the original. :meth:`pull_options`
    copies the original groups' options (a scheduler stepping the original, or
    ``mpar.DistributedOptimizer``) into them; a loaded state's options are written
    back to the original groups, so both agree after a load.
    """

    def __init__(self, sharded: ShardedStages, optimizer: torch.optim.Optimizer) -> None:
        self.sharded = sharded
        local = {id(p): i for i, p in enumerate(sharded.params)}
        self.group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        self.original_index: dict[int, int] = {}
        """Local parameter index -> index in the original optimizer's state_dict."""
        group_of: dict[int, int] = {}
        position = 0
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in local:
                    self.original_index[local[id(p)]] = position
                    group_of[local[id(p)]] = g
                position += 1
        self.segments = self._make_segments(group_of.get)
        self.bucket_segments: list[list[SegmentParam]] = [[] for _ in sharded.buckets]
        """The segments of each bucket (what :meth:`_step_buckets` steps)."""
        for sp in self.segments:
            self.bucket_segments[sp.bucket_index].append(sp)
        groups: list[dict[str, Any]] = []
        for g, group in enumerate(optimizer.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            params = [sp.param for sp in self.segments if sp.segment.group == g]
            groups.append({**options, "params": params})
        self.fused_on_host = fuses_on_host(optimizer, sharded)
        """Stepping with the fused CPU kernel, which the user did not ask for: state
        dicts show the user's own ``fused`` option."""
        self.user_fused = optimizer.defaults.get("fused")
        self.inner = _rebuild(optimizer, groups, self.fused_on_host)
        self.original = optimizer
        """The optimizer built over the model, whose groups' options :meth:`pull_options`
        reads."""
        self.by_bucket = type(optimizer) in _HOST_FUSED and sharded.offloads
        """Offloaded: step one bucket at a time, each published as soon as it is updated,
        so that its copy to the device runs while the host updates the next
        (:meth:`step`). Only for the per-parameter optimizers of :data:`_HOST_FUSED`,
        whose update of a parameter reads nothing of the others: the same values either
        way (and so on the CPU too, where the offload tests run it)."""

    def _make_segments(self, group_of: Callable[[int], int | None]) -> list[SegmentParam]:
        out = []
        for b, bucket in enumerate(self.sharded.buckets):
            lo, hi = bucket.opt_range
            for seg in segments_of(bucket.spec, lo, hi, group_of):
                view = bucket.master[seg.lo - lo : seg.hi - lo]
                out.append(SegmentParam(bucket, b, seg, nn.Parameter(view), _runs(bucket, seg)))
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def _options(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """``group``'s options, less its parameters and the ``fused`` that mpar chose."""
        skip = {"params", "fused"} if self.fused_on_host else {"params"}
        return {k: v for k, v in group.items() if k not in skip}

    def pull_options(self) -> None:
        """Copy the original optimizer's group options (learning rate, weight decay, ...)
        into the rebuilt groups: what a scheduler or the user set on the original."""
        for original, inner in zip(self.original.param_groups, self.inner.param_groups):
            inner.update(self._options(original))

    def _push_options(self) -> None:
        """After a load: the loaded options onto the original groups too."""
        for original, inner in zip(self.original.param_groups, self.inner.param_groups):
            original.update(self._options(inner))

    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, object]]:
        """The rebuilt optimizer's state, per flat parameter (``SegmentParam.param``)."""
        return self.inner.state

    def load_segment_states(
        self, states: Mapping[int, dict[str, object]], options: Sequence[Mapping[str, object]]
    ) -> None:
        """Give the rebuilt optimizer ``states`` (index in :attr:`segments` -> that flat
        parameter's state) and each group's ``options`` (one per original group)."""
        params = [p for g in self.inner.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        state = {index[id(self.segments[i].param)]: values for i, values in states.items()}
        groups, start = [], 0
        for opts, group in zip(options, self.inner.param_groups):
            size = len(group["params"])
            groups.append({**opts, "params": list(range(start, start + size))})
            start += size
        self.inner.load_state_dict({"state": state, "param_groups": groups})
        self._push_options()

    # ------------------------------------------------------------------ step
    def step(self, closure: Callable[[], object] | None = None) -> None:
        """Update this rank's shard, then publish it to the parameters."""
        if closure is not None:
            raise ValueError("ShardedOptimizer.step() does not take a closure")
        if self.by_bucket:
            # the backward's order: the last buckets' gradients reach the host first, so
            # each bucket steps once its own copy has landed while later ones still copy
            # (every rank steps, and publishes, in the same order)
            by_bucket = self.sharded.landing_by_bucket()
            works = []
            for b in reversed(range(len(self.sharded.buckets))):
                bucket = self.sharded.buckets[b]
                if by_bucket:
                    bucket.wait_landed()
                self._step_buckets([b])
                works.append(bucket.start_publish())  # copied while the next one steps
            self.sharded.finish_publish(works)
            return
        self.sharded.synchronize()
        self._step_buckets(range(len(self.sharded.buckets)))
        self.sharded.publish_masters()

    def _step_buckets(self, indices: Sequence[int]) -> None:
        """One step of the inner optimizer over the segments of buckets ``indices``
        (parameters without a gradient are skipped by every torch optimizer)."""
        buckets = self.sharded.buckets
        grads = {b: buckets[b].grads.opt_grad() for b in indices}
        segments = [sp for b in indices for sp in self.bucket_segments[b]]
        for sp in segments:
            grad = grads[sp.bucket_index]
            sp.param.grad = None if grad is None else sp.slice(grad)
        if any(sp.param.grad is not None for sp in segments):
            self.inner.step()
        for sp in segments:
            sp.param.grad = None  # under mixed precision, frees the step's fp32 gradients
        for b in indices:
            buckets[b].grads.stepped()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sharded.zero_grad(set_to_none)
        for sp in self.segments:
            sp.param.grad = None

    def grad_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (sum-all-reduce it)."""
        self.sharded.synchronize()  # offloaded gradients: landed on the host
        total = torch.zeros((), dtype=torch.float32, device=self.sharded.device)
        for bucket in self.sharded.buckets:
            total += bucket.grads.grad_sq_sum()
        return total

    def nonfinite_flag(self) -> torch.Tensor:
        """1.0 (float32, on the device) when this rank's share of the reduced gradients
        holds an inf or NaN, else 0.0: one flag for all buckets, read by nobody here."""
        self.sharded.synchronize()
        flag = torch.zeros((), dtype=torch.float32, device=self.sharded.device)
        for bucket in self.sharded.buckets:
            flag = torch.maximum(flag, bucket.grads.nonfinite())
        return flag

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply the reduced gradients by ``factor`` (gradient clipping); a tensor
        factor stays on the device (no host read)."""
        for bucket in self.sharded.buckets:
            bucket.grads.scale_grads(factor)

    # ----------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state (collective over the group), in torch's format.

        Keyed like the original optimizer's ``state_dict`` over its original
        parameter order; covers the parameters of this rank's stages (the
        other pipeline ranks' entries are theirs to add). Tensors on the CPU.
        """
        return gather_full_state(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state; loads only into the same layout."""
        return {
            "format": SHARDED_FORMAT,
            "layout": self.layout(),
            "optimizer": self.inner.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (torch-format) or sharded state dict."""
        if state_dict.get("format") == SHARDED_FORMAT:
            if state_dict["layout"] != self.layout():
                raise ValueError(
                    "sharded optimizer state was saved with a different layout "
                    f"({state_dict['layout']}) than this one ({self.layout()}); load the full "
                    "state_dict() instead when the data-parallel size or buckets change"
                )
            self.inner.load_state_dict(state_dict["optimizer"])
        else:
            self.inner.load_state_dict(split_full_state(self, state_dict))
        self._push_options()

    def layout(self) -> dict[str, Any]:
        """What a sharded state dict depends on (compared when loading one)."""
        return {
            "zero_stage": self.sharded.zero.stage,
            "group_size": self.sharded.comm.size,
            "rank": self.sharded.comm.rank,
            "expert_group": [self.sharded.expert_comm.size, self.sharded.expert_comm.rank],
            "segments": [
                [sp.bucket_index, sp.segment.group, sp.segment.lo, sp.segment.hi]
                for sp in self.segments
            ],
        }

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of optimizer state (for memory reports)."""
        tensors = [b.master for b in self.sharded.buckets]
        for values in self.inner.state.values():
            tensors += [v for v in values.values() if torch.is_tensor(v)]
        return tensors
