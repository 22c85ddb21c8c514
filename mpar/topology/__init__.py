"""The pipeline x data-parallel x tensor-parallel rank grid (pure: no processes needed).

Each rank has coordinates ``(pp_rank, dp_rank, tp_rank)``; the tensor-parallel
axis is innermost (a TP group's ranks are consecutive, on one host) and has size
1 until tensor parallelism lands. Two placements map the outer coordinates to
global ranks::

    cluster (default): rank = (dp_rank * pp + pp_rank) * tp + tp_rank   # one pipeline's
                                                                         # stages on consecutive ranks
    spread:            rank = (pp_rank * dp + dp_rank) * tp + tp_rank   # one data-parallel
                                                                         # group's ranks consecutive

    world 8, pp 2, tp 1     cluster           spread
                      dp_rank: 0 1 2 3    0 1 2 3
                pp_rank 0:     0 2 4 6    0 1 2 3
                pp_rank 1:     1 3 5 7    4 5 6 7

The process groups along each axis live in :class:`mpar.comm.ProcessGrid`, built
on this grid (``mesh()`` is its torch ``DeviceMesh`` layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mpar.errors import ConfigError

__all__ = ["AXES", "Grid", "make_grid"]

AXES = ("pp", "dp", "tp")
"""The grid's axis names, outermost first (the ``DeviceMesh`` dimension names)."""


@dataclass(frozen=True)
class Grid:
    """The rank layout of a job: ``world_size = pp_size * dp_size * tp_size``."""

    world_size: int
    pp_size: int
    placement: Literal["cluster", "spread"] = "cluster"
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world_size < 1 or self.world_size % self.tp_size:
            raise ConfigError(
                f"tensor parallel degree {self.tp_size} must divide the world size "
                f"{self.world_size}"
            )
        if self.pp_size < 1 or (self.world_size // self.tp_size) % self.pp_size:
            raise ConfigError(
                f"pipeline degree {self.pp_size} must divide the world size {self.world_size}"
                + (f" / tensor parallel degree {self.tp_size}" if self.tp_size > 1 else "")
            )
        if self.placement not in ("cluster", "spread"):
            raise ConfigError(
                f"placement_strategy {self.placement!r} is not one of 'cluster', 'spread'"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.pp_size * self.tp_size)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        """Global rank at grid coordinates ``(pp_rank, dp_rank, tp_rank)``."""
        if not (
            0 <= pp_rank < self.pp_size
            and 0 <= dp_rank < self.dp_size
            and 0 <= tp_rank < self.tp_size
        ):
            raise ValueError(
                f"grid coordinates ({pp_rank}, {dp_rank}, {tp_rank}) outside a "
                f"{self.pp_size} x {self.dp_size} x {self.tp_size} grid"
            )
        if self.placement == "cluster":
            outer = dp_rank * self.pp_size + pp_rank
        else:
            outer = pp_rank * self.dp_size + dp_rank
        return outer * self.tp_size + tp_rank

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        outer, tp_rank = divmod(rank, self.tp_size)
        if self.placement == "cluster":
            return outer % self.pp_size, outer // self.pp_size, tp_rank
        return outer // self.dp_size, outer % self.dp_size, tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of a global rank."""
        pp_rank, dp_rank, _ = self.coordinates(rank)
        return pp_rank, dp_rank

    def pp_group(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        """Ranks of one pipeline (a model replica), in stage order."""
        return [self.rank_of(p, dp_rank, tp_rank) for p in range(self.pp_size)]

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """Ranks holding the same pipeline stage, in data-parallel order."""
        return [self.rank_of(pp_rank, d, tp_rank) for d in range(self.dp_size)]

    def tp_group(self, pp_rank: int, dp_rank: int) -> list[int]:
        """Ranks that split the same layers (one batch), in tensor-parallel order."""
        return [self.rank_of(pp_rank, dp_rank, t) for t in range(self.tp_size)]

    @property
    def pp_groups(self) -> list[list[int]]:
        return [self.pp_group(d, t) for d in range(self.dp_size) for t in range(self.tp_size)]

    @property
    def dp_groups(self) -> list[list[int]]:
        return [self.dp_group(p, t) for p in range(self.pp_size) for t in range(self.tp_size)]

    @property
    def tp_groups(self) -> list[list[int]]:
        return [self.tp_group(p, d) for p in range(self.pp_size) for d in range(self.dp_size)]

    def mesh(self) -> list[list[list[int]]]:
        """The global ranks indexed ``[pp_rank][dp_rank][tp_rank]`` (a DeviceMesh's layout)."""
        return [[self.tp_group(p, d) for d in range(self.dp_size)] for p in range(self.pp_size)]

    def __str__(self) -> str:
        width = len(str(self.world_size - 1))
        header = " " * 11 + " ".join(f"{d:>{width}}" for d in range(self.dp_size))
        tp = f" x {self.tp_size} (tp)" if self.tp_size > 1 else ""
        rows = [
            f"grid {self.pp_size} (pp) x {self.dp_size} (dp){tp}, {self.placement}",
            "dp_rank:" + header[8:],
        ]
        for p in range(self.pp_size):
            cells = " ".join(f"{r:>{width}}" for r in self.dp_group(p))
            rows.append(f"pp_rank {p:>{width}}: {cells}")
        return "\n".join(rows)


def make_grid(
    world_size: int,
    pp_size: int,
    placement: Literal["cluster", "spread"] = "cluster",
    tp_size: int = 1,
) -> Grid:
    """The grid of ``world_size`` ranks with ``pp_size`` pipeline stages each."""
    return Grid(world_size, pp_size, placement, tp_size)
