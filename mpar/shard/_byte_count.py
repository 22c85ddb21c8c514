"""Counting the bytes a rank holds, by device and category (each storage once)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mpar import _device

__all__ = ["count_bytes"]


def count_bytes(groups: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, dict[str, int]]:
    """Bytes of the distinct storages in ``groups``: ``{device: {category: bytes}}``.

    A storage seen in several categories (a parameter view of a flat buffer,
    an optimizer parameter that is a view of the parameters) counts once,
    under the first category it appears in. Every device has every category.
    """
    seen: set[tuple[str, int]] = set()
    report: dict[str, dict[str, int]] = {}
    for category, tensors in groups.items():
        for tensor in tensors:
            storage = tensor.untyped_storage()
            device = str(tensor.device)
            row = report.setdefault(device, dict.fromkeys(groups, 0))
            key = (device, _device.storage_key(tensor))
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            row[category] += storage.nbytes()
    return report
