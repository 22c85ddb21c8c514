"""A tqdm progress bar on global rank 0 only (other ranks get a silent stand-in)."""

from __future__ import annotations

from typing import Any

import mpar


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, description: str) -> Any:
    """A bar counting ``total`` steps on rank 0; call ``.update()`` and ``.set_postfix()``."""
    if mpar.rank() != 0:
        return _Silent()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="step", mininterval=1.0)
