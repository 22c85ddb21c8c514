"""Byte sizes written by people: ``"16GiB"``, ``"40GB"``, ``512`` (a leaf: no mpar imports).

The config (``device_memory``), the partition planner and the CLI read sizes
with :func:`parse_bytes`.
"""

from __future__ import annotations

import re

__all__ = ["parse_bytes"]

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float) -> int:
    """``"16GiB"`` → 17179869184; ``"16GB"`` → 16e9; a bare number is bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 16GiB, 40GB, 512MiB")
    value, unit = float(match.group(1)), match.group(2).lower().rstrip("b")
    if not unit:
        return int(value)
    base = 1024 if unit.endswith("i") else 1000
    power = "kmgtp".index(unit[0]) + 1
    return int(value * base**power)
