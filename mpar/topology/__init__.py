"""The pipeline x data-parallel rank grid (pure: no processes needed).

Each rank has coordinates ``(pp_rank, dp_rank)``. Two placements map
coordinates to global ranks::

    cluster (default): rank = dp_rank * pp + pp_rank   # one pipeline's stages on
                                                       # consecutive ranks (same host)
    spread:            rank = pp_rank * dp + dp_rank   # one data-parallel group's
                                                       # ranks consecutive

    world 8, pp 2           cluster           spread
                      dp_rank: 0 1 2 3    0 1 2 3
                pp_rank 0:     0 2 4 6    0 1 2 3
                pp_rank 1:     1 3 5 7    4 5 6 7
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mpar.errors import ConfigError

__all__ = ["Grid", "make_grid"]


@dataclass(frozen=True)
class Grid:
    """The rank layout of a job: ``world_size = pp_size * dp_size``."""

    world_size: int
    pp_size: int
    placement: Literal["cluster", "spread"] = "cluster"

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.pp_size < 1 or self.world_size % self.pp_size:
            raise ConfigError(
                f"pipeline degree {self.pp_size} must divide the world size {self.world_size}"
            )
        if self.placement not in ("cluster", "spread"):
            raise ConfigError(
                f"placement_strategy {self.placement!r} is not one of 'cluster', 'spread'"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // self.pp_size

    def rank_of(self, pp_rank: int, dp_rank: int) -> int:
        """Global rank at grid coordinates ``(pp_rank, dp_rank)``."""
        if not (0 <= pp_rank < self.pp_size and 0 <= dp_rank < self.dp_size):
            raise ValueError(
                f"grid coordinates ({pp_rank}, {dp_rank}) outside a "
                f"{self.pp_size} x {self.dp_size} grid"
            )
        if self.placement == "cluster":
            return dp_rank * self.pp_size + pp_rank
        return pp_rank * self.dp_size + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        if self.placement == "cluster":
            return rank % self.pp_size, rank // self.pp_size
        return rank // self.dp_size, rank % self.dp_size

    def pp_group(self, dp_rank: int) -> list[int]:
        """Ranks of one pipeline (a model replica), in stage order."""
        return [self.rank_of(p, dp_rank) for p in range(self.pp_size)]

    def dp_group(self, pp_rank: int) -> list[int]:
        """Ranks holding the same pipeline stage, in data-parallel order."""
        return [self.rank_of(pp_rank, d) for d in range(self.dp_size)]

    @property
    def pp_groups(self) -> list[list[int]]:
        return [self.pp_group(d) for d in range(self.dp_size)]

    @property
    def dp_groups(self) -> list[list[int]]:
        return [self.dp_group(p) for p in range(self.pp_size)]

    def __str__(self) -> str:
        width = len(str(self.world_size - 1))
        header = " " * 11 + " ".join(f"{d:>{width}}" for d in range(self.dp_size))
        rows = [
            f"grid {self.pp_size} (pp) x {self.dp_size} (dp), {self.placement}",
            "dp_rank:" + header[8:],
        ]
        for p in range(self.pp_size):
            cells = " ".join(f"{r:>{width}}" for r in self.dp_group(p))
            rows.append(f"pp_rank {p:>{width}}: {cells}")
        return "\n".join(rows)


def make_grid(
    world_size: int, pp_size: int, placement: Literal["cluster", "spread"] = "cluster"
) -> Grid:
    """The grid of ``world_size`` ranks with ``pp_size`` pipeline stages each."""
    return Grid(world_size, pp_size, placement)
