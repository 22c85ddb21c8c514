"""Rank bodies recording the stream seam's calls (``mpar.testing.streams``) while training,
with marks that place them: which unit group's hook, or which step phase, runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def _marked(fn: Callable[..., Any], label: Callable[..., str]) -> Callable[..., Any]:
    from mpar.testing.streams import mark

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(label(*args, **kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            mark("end")

    return wrapper


def _group_label(units: Any, g: int) -> str:
    return "run " + "|".join(b.label for b in units.groups[g].buckets)


def recorded_training(
    config: dict[str, Any], steps: int, clip: float | None = 0.5
) -> dict[str, Any]:
    """Train the mlp (AdamW, clipping at ``clip``) recording the seam; marks around each
    unit group's pre-forward / pre-backward hook (``run <its buckets>``), the
    stage-wide gathers' wait, the end-of-step reduction wait, the optimizer's
    publication, its step of each bucket (``step <bucket>``) and the user's read of
    the parameters (``read``). Also returns the sync ledger's counts over the training
    (``syncs``)."""
    from mpar import _device
    from mpar.shard._sharded_optimizer import ShardedOptimizer
    from mpar.shard._sharded_stages import ShardedStages
    from mpar.shard._unit_gather import UnitGather
    from mpar.testing.streams import record_streams
    from tests.multiproc._pipeline_cases import train_ranks

    UnitGather.pre_forward = _marked(UnitGather.pre_forward, _group_label)  # type: ignore[method-assign]
    UnitGather.pre_backward = _marked(UnitGather.pre_backward, _group_label)  # type: ignore[method-assign]
    ShardedStages.wait_unsharded = _marked(  # type: ignore[method-assign]
        ShardedStages.wait_unsharded,
        lambda self, s: "run " + "|".join(b.label for b in self._stages[s].wide),
    )
    ShardedStages.finish_grads = _marked(ShardedStages.finish_grads, lambda self: "finish_grads")  # type: ignore[method-assign]
    ShardedStages.publish_masters = _marked(  # type: ignore[method-assign]
        ShardedStages.publish_masters, lambda self: "publish"
    )
    ShardedOptimizer._step_buckets = _marked(  # type: ignore[method-assign]
        ShardedOptimizer._step_buckets,
        lambda self, indices: "step " + "|".join(self.sharded.buckets[b].label for b in indices),
    )
    import mpar

    mpar.DistributedModel.state_dict = _marked(  # type: ignore[method-assign]
        mpar.DistributedModel.state_dict, lambda *a, **k: "read"
    )
    _device.SYNCS.take()
    with record_streams() as log:
        result = train_ranks(config, "mlp", "adamw", steps, clip)
    return {
        "losses": result["losses"],
        "state": result["state"],
        "log": [tuple(r) for r in log],
        "syncs": _device.SYNCS.take(),
    }
