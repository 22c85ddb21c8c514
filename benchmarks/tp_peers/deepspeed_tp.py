"""DeepSpeed AutoTP for training (placeholder while it is tried)."""

from __future__ import annotations

from typing import Any


def unsupported() -> str | None:
    return None


def run(case: Any) -> dict[str, Any]:
    raise NotImplementedError
