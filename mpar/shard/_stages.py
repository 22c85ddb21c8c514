"""``ShardedStages``: ZeRO storage and actions for one rank's pipeline stages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpar.config import ZeroConfig
from mpar.shard._bucket import FlatBucket, GroupInfo
from mpar.shard._layout import plan_buckets
from mpar.shard._memory import count_bytes

if TYPE_CHECKING:
    from mpar.shard._optimizer import ShardedOptimizer

__all__ = ["ShardedStages"]


def _collect(
    stages: Mapping[int, nn.Module],
) -> tuple[dict[int, list[nn.Parameter]], list[nn.Parameter]]:
    """Trainable parameters per stage (each under its lowest stage) and frozen ones."""
    seen: set[int] = set()
    owned: dict[int, list[nn.Parameter]] = {}
    frozen: list[nn.Parameter] = []
    for s in sorted(stages):
        owned[s] = []
        for p in stages[s].parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                owned[s].append(p)
            else:
                frozen.append(p)
    return owned, frozen


class ShardedStages:
    """ZeRO stages 0-3 (with CPU offload) over one data-parallel group.

    See the :mod:`mpar.shard` docstring for the contract. ``stages`` maps
    this rank's stage indices to their modules; a parameter that appears in
    two of them is stored, reduced and updated once, under the lower stage
    (whose last backward of a step comes last).
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        zero: ZeroConfig,
        *,
        group: Any,
        group_ranks: Sequence[int],
        rank_in_group: int,
        device: torch.device | str,
    ) -> None:
        if not stages:
            raise ValueError("ShardedStages needs at least one stage module, got an empty dict")
        if not 0 <= rank_in_group < len(group_ranks):
            raise ValueError(
                f"rank_in_group {rank_in_group} is not a position in group_ranks {list(group_ranks)}"
            )
        self.zero = zero
        self.device = torch.device(device)
        self.comm = GroupInfo(group, tuple(group_ranks), rank_in_group)
        self.stages = dict(stages)
        owned, self.frozen = _collect(stages)
        self.params = [p for s in sorted(owned) for p in owned[s]]
        """Trainable local parameters, each once, in stage then module order."""
        self.buckets = self._make_buckets(owned)
        self._owned = {s: [b for b in self.buckets if b.spec.stage == s] for s in self.stages}
        self._used = {s: self._buckets_used_by(m) for s, m in self.stages.items()}
        self.optimizer: ShardedOptimizer | None = None

    def _make_buckets(self, owned: dict[int, list[nn.Parameter]]) -> list[FlatBucket]:
        index = {id(p): i for i, p in enumerate(self.params)}
        itemsize = max((p.element_size() for p in self.params), default=4)
        bucket_elems = max(1, int(self.zero.bucket_mb * 2**20) // itemsize)
        specs = plan_buckets(
            {
                s: [(index[id(p)], p.numel(), (p.dtype, p.device)) for p in ps]
                for s, ps in owned.items()
            },
            group_size=self.comm.size,
            bucket_elems=bucket_elems,
        )
        return [
            FlatBucket(
                spec,
                [self.params[slot.index] for slot in spec.slots],
                zero_stage=self.zero.stage,
                offload_optimizer=self.zero.offload_optimizer == "cpu",
                offload_params=self.zero.offload_params == "cpu",
                comm=self.comm,
                device=self.device,
            )
            for spec in specs
        ]

    def _buckets_used_by(self, module: nn.Module) -> list[FlatBucket]:
        ids = {id(p) for p in module.parameters()}
        return [b for b in self.buckets if any(id(p) in ids for p in b.params)]

    def _stage(self, s: int) -> int:
        if s not in self.stages:
            raise ValueError(
                f"stage {s} is not held by this rank (local stages: {sorted(self.stages)})"
            )
        return s

    # ------------------------------------------------------------ schedule actions
    def unshard(self, s: int) -> None:
        """ZeRO-3: gather stage ``s``'s parameters into its module (no-op otherwise)."""
        for bucket in self._used[self._stage(s)]:
            bucket.acquire(s)

    def reshard(self, s: int) -> None:
        """ZeRO-3: free stage ``s``'s gathered parameters, keeping the local shard."""
        for bucket in self._used[self._stage(s)]:
            bucket.release(s)

    def sync_from_params(self, s: int) -> None:
        """Stage ``s``'s (gathered) parameters were overwritten in place: update the
        shards and master copies from them."""
        for bucket in self._used[self._stage(s)]:
            bucket.sync_from_full()

    def reduce_grads(self, s: int) -> None:
        """Start the sum reduction of stage ``s``'s gradients (after its last backward)."""
        for bucket in self._owned[self._stage(s)]:
            bucket.reduce()

    def reduce_grads_in_backward(self, s: int) -> None:
        """Let stage ``s``'s next backward start its reductions bucket by bucket.

        Call it right before the stage's last backward of the step (the B
        followed by REDUCE_GRAD in the lowered schedule): each bucket's
        reduction then starts as soon as autograd has accumulated the last of
        its gradients, overlapping communication with the rest of the
        backward. ``reduce_grads(s)`` is still called after it and starts the
        buckets whose parameters got no gradient.
        """
        for bucket in self._owned[self._stage(s)]:
            bucket.arm()

    def finish_grads(self) -> None:
        """Wait for every pending reduction (end of the step's schedule)."""
        for bucket in self.buckets:
            bucket.finish_reduce()
        self.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            bucket.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Wait for non-blocking host/device copies (CUDA offload)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------ optimizer, report
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """The same optimizer class and hyperparameters over this rank's flat shards."""
        from mpar.shard._optimizer import ShardedOptimizer

        self.optimizer = ShardedOptimizer(self, optimizer)
        return self.optimizer

    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by device, then ``parameters``/``gradients``/``optimizer``."""
        groups: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "optimizer": []}
        groups["parameters"] += [p.data for p in self.frozen]
        groups["gradients"] += [p.grad for p in self.frozen if p.grad is not None]
        for bucket in self.buckets:
            for key, tensors in bucket.tensors().items():
                groups[key] += tensors
        if self.optimizer is not None:
            groups["optimizer"] += self.optimizer.state_tensors()
        return count_bytes(groups)
