"""Byte sizes and bandwidths written by people: ``"16GiB"``, ``"40GB"``, ``512``,
``"10GB/s"`` (a leaf: no mpar imports).

The config (``device_memory``), the partition planner and the CLI read sizes
with :func:`parse_bytes` and bandwidths (``--link-bandwidth`` and the like) with
:func:`parse_bandwidth`.
"""

from __future__ import annotations

import re

__all__ = ["parse_bandwidth", "parse_bytes"]

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


def parse_bandwidth(value: str | float | None, name: str = "bandwidth") -> float | None:
    """Bytes per second: ``"10GB"`` or ``"10GB/s"`` → 1e10, a number as given, None as
    None (communication left out). ``name`` names the value in the error for one that is
    not a positive size."""
    if value is None:
        return None
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    bandwidth = float(parse_bytes(text))
    if not bandwidth > 0:
        raise ValueError(
            f"{name} must be a positive number of bytes per second (e.g. 10GB), "
            f"got {value!r}; pass None to leave communication out"
        )
    return bandwidth
