"""Every rank must run with the same configuration: checked once, at ``mpar.init``.

Ranks whose ``microbatches``, ``pipeline`` or ``virtual_stages`` differ build
different schedules and would wait for each other forever (or exchange the
wrong tensors); one small all-gather at start-up turns that into an error
naming both ranks and the keys.
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

from mpar.comm._progress import Waiting
from mpar.config import Config
from mpar.errors import ConfigError

__all__ = ["check_same_config", "config_differences", "first_few", "gather_from_every_rank"]

_PER_RANK_KEYS = frozenset({"trace"})
"""Keys that may differ between ranks (a trace folder on each node's own disk)."""

T = TypeVar("T")


def _flat(config: Config) -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        elif key not in _PER_RANK_KEYS:
            flat[key] = value
    return flat


def config_differences(configs: list[dict[str, object]]) -> list[str]:
    """``"rank 1 has microbatches=4 where rank 0 has 2"`` for each key that differs."""
    first = configs[0]
    found = []
    for rank, other in enumerate(configs[1:], start=1):
        for key in sorted(first):
            if other.get(key) != first[key]:
                found.append(
                    f"rank {rank} has {key}={other.get(key)!r} where rank 0 has {first[key]!r}"
                )
    return found


def check_same_config(config: Config, world_size: int) -> None:
    """Raise :class:`ConfigError` on every rank unless all ranks hold the same config."""
    if world_size == 1:
        return
    gathered: list[dict[str, object]] = [{}] * world_size  # placeholders, overwritten
    with Waiting(("collective", "all_gather_object (config check)", None)):
        dist.all_gather_object(gathered, _flat(config))
    differences = config_differences(gathered)
    if differences:
        shown = first_few(differences, 6)
        raise ConfigError(
            f"the ranks were started with different configurations: {shown}. Give every rank "
            "the same config (the same file or MPAR_CONFIG): ranks with different schedules "
            "would wait for each other forever"
        )


def first_few(problems: list[str], most: int) -> str:
    """The first ``most`` of ``problems``, joined for an error message."""
    return "; ".join(problems[:most]) + ("; ..." if len(problems) > most else "")


def gather_from_every_rank(obj: T, world_size: int, what: str) -> list[T]:
    """Every rank's small picklable ``obj``, in rank order (a watched all-gather)."""
    if world_size == 1:
        return [obj]
    gathered: list[T] = [obj] * world_size  # placeholders, overwritten
    with Waiting(("collective", f"all_gather_object ({what})", None)):
        dist.all_gather_object(gathered, obj)
    return gathered
