"""The pipeline x data-parallel x tensor-parallel rank grid (pure: no processes needed).

Each rank has coordinates ``(pp_rank, dp_rank, tp_rank)``. The placement
(``placement_strategy``) orders the three axes from outermost to innermost; the
innermost varies fastest over consecutive global ranks (one host's ranks), the
outermost slowest::

    cluster = "DPT" (default): rank = (dp_rank * pp + pp_rank) * tp + tp_rank
    spread  = "PDT":           rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    "TPD":                     rank = (tp_rank * pp + pp_rank) * dp + dp_rank

``cluster`` puts one pipeline's stages on consecutive ranks, ``spread`` one
data-parallel group's; both keep the TP group innermost (its ranks consecutive, on
one host). Any permutation of the letters ``D``, ``P``, ``T`` names the order
directly, as SageMaker model parallelism spells it::

    world 8, pp 2, tp 1     cluster           spread
                      dp_rank: 0 1 2 3    0 1 2 3
                pp_rank 0:     0 2 4 6    0 1 2 3
                pp_rank 1:     1 3 5 7    4 5 6 7

The process groups along each axis live in :class:`mpar.comm.ProcessGrid`, built
on this grid (``mesh()`` is its torch ``DeviceMesh`` layout, indexed by coordinates
whatever the placement).

Expert parallelism takes no axis of its own: it folds into the data-parallel ranks of
each (pp_rank, tp_rank), as Megatron-LM folds it. Those ranks, in dp order
(:meth:`Grid.folded_ranks`), are cut into consecutive *ep groups* of ``ep_size``
ranks that split each MoE layer's experts; the ranks at the same place of every ep
group hold the same experts and form an *expert-data-parallel* (edp) group::

    dp 4, ep 2:   dp_rank   0 1 | 2 3
                  ep_rank   0 1 | 0 1      ep groups {0,1} {2,3}
                  edp_rank  0 0 | 1 1      edp groups {0,2} {1,3}
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import ClassVar

from mpar.errors import ConfigError

__all__ = ["AXES", "PLACEMENT_NAMES", "Grid", "GridShape", "make_grid", "placement_axes"]


#: The named placements as axis letters, outermost first (``D`` data parallel, ``P``
#: pipeline, ``T`` tensor parallel): both keep the TP group's ranks consecutive.
PLACEMENT_NAMES = {"cluster": "DPT", "spread": "PDT"}
_AXIS_OF_LETTER = {"P": "pp", "D": "dp", "T": "tp"}


def placement_axes(placement: object) -> tuple[str, str, str]:
    """The grid axes (``"pp"``, ``"dp"``, ``"tp"``) of a ``placement_strategy`` value,
    outermost first: the last one varies fastest over consecutive global ranks.

    ``"cluster"`` is ``"DPT"`` (one pipeline's stages on neighbouring ranks),
    ``"spread"`` is ``"PDT"`` (one data-parallel group's ranks neighbouring); any
    permutation of ``D``, ``P``, ``T`` names the order directly, as SageMaker model
    parallelism spells it (``"TPD"``: the TP group's ranks as far apart as possible).
    """
    letters = PLACEMENT_NAMES.get(placement, placement) if isinstance(placement, str) else None
    if not isinstance(letters, str) or sorted(letters) != ["D", "P", "T"]:
        raise ConfigError(
            f"config key 'placement_strategy' has value {placement!r}; allowed: 'cluster', "
            "'spread', or a permutation of the letters D (data parallel), P (pipeline), "
            "T (tensor parallel) naming the axes outermost first, e.g. 'DPT' (= 'cluster'), "
            "'PDT' (= 'spread'), 'TPD'"
        )
    a, b, c = (_AXIS_OF_LETTER[x] for x in letters)
    return a, b, c


AXES = ("pp", "dp", "tp")
"""The grid's axis names, outermost first (the ``DeviceMesh`` dimension names)."""


@dataclass(frozen=True)
class GridShape:
    """The size of each axis of the rank grid: all that a plan needs to know of it.

    The one record of the axes that the runtime (``Grid.shape``), ``mpar plan`` and
    the ``"auto"`` search read (``mpar.partition.PlanInputs.grid``).

    Adding an axis (context parallel ``cp``, expert parallel ``ep``) is one field here,
    default 1, and the line of ``mpar.config.Config.grid_shape`` that reads its config
    key: :attr:`world_size`, :meth:`for_world` and equality follow the fields. An axis
    that takes no ranks of its own (``ep``, folded into dp x cp as Megatron folds it)
    is also named in ``FOLDED``, so the world size leaves it out.
    """

    pp: int = 1
    """Pipeline stages (ranks per pipeline)."""
    dp: int = 1
    """Data-parallel replicas of each stage."""
    tp: int = 1
    """Ranks that split each layer (one TP group)."""
    ep: int = 1
    """Ranks that split each MoE layer's experts, folded into ``dp`` (no ranks of its own)."""

    FOLDED: ClassVar[frozenset[str]] = frozenset({"ep"})
    """Axes that reuse the ranks of others."""

    def __post_init__(self) -> None:
        for f in fields(self):
            size = getattr(self, f.name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"grid axis {f.name} must be a positive integer, got {size!r}")
        if self.dp % self.ep:
            raise ConfigError(
                f"expert parallel degree {self.ep} must divide the data-parallel degree "
                f"{self.dp} (expert parallelism folds into the dp ranks)"
            )

    @property
    def world_size(self) -> int:
        """Ranks in the grid: the product of the axes that take ranks of their own."""
        return math.prod(getattr(self, f.name) for f in fields(self) if f.name not in self.FOLDED)

    @classmethod
    def for_world(cls, world_size: int, **degrees: int) -> GridShape:
        """The shape with the given axis ``degrees`` (``pp=2, tp=2``) where data
        parallelism takes what they leave of ``world_size``."""
        taken = math.prod(size for axis, size in degrees.items() if axis not in cls.FOLDED)
        if taken < 1 or world_size % taken:
            named = " x ".join(f"{axis} {size}" for axis, size in degrees.items())
            raise ConfigError(f"{named} = {taken} does not divide the world size {world_size}")
        return cls(**degrees, dp=world_size // taken)


@dataclass(frozen=True)
class Grid:
    """The rank layout of a job: ``world_size = pp_size * dp_size * tp_size``."""

    world_size: int
    pp_size: int
    placement: str = "cluster"
    """``"cluster"``, ``"spread"`` or a permutation of ``D``, ``P``, ``T`` (outermost first)."""
    tp_size: int = 1
    ep_size: int = 1
    """Ranks that split each MoE layer's experts, folded into dp (see the module)."""
    axes: tuple[str, str, str] = field(init=False, repr=False, compare=False)
    """The axis names outermost first, from ``placement`` (``cluster``: dp, pp, tp)."""

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
        object.__setattr__(self, "axes", placement_axes(self.placement))
        if self.ep_size < 1 or self.dp_size % self.ep_size:
            raise ConfigError(
                f"expert parallel degree {self.ep_size} must divide the data-parallel "
                f"degree {self.dp_size} (expert parallelism folds into the dp ranks)"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.pp_size * self.tp_size)

    @property
    def shape(self) -> GridShape:
        """The size of each axis."""
        return GridShape(pp=self.pp_size, dp=self.dp_size, tp=self.tp_size, ep=self.ep_size)

    def _sizes(self) -> dict[str, int]:
        return {"pp": self.pp_size, "dp": self.dp_size, "tp": self.tp_size}

    @property
    def order(self) -> str:
        """The placement as axis letters, outermost first (``cluster``: ``"DPT"``)."""
        return "".join({"pp": "P", "dp": "D", "tp": "T"}[a] for a in self.axes)

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
        coords, sizes, rank = {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}, self._sizes(), 0
        for axis in self.axes:  # mixed radix, the outermost axis the most significant
            rank = rank * sizes[axis] + coords[axis]
        return rank

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        coords: dict[str, int] = {}
        sizes = self._sizes()
        for axis in reversed(self.axes):  # the innermost axis is the least significant
            rank, coords[axis] = divmod(rank, sizes[axis])
        return coords["pp"], coords["dp"], coords["tp"]

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

    def folded_ranks(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """The ranks expert parallelism folds into, in order: the data-parallel group
        of ``(pp_rank, tp_rank)`` (the one place to widen when a context-parallel axis
        joins the ranks that share nothing but the model)."""
        return self.dp_group(pp_rank, tp_rank)

    def ep_coordinates(self, rank: int) -> tuple[int, int]:
        """``(ep_rank, edp_rank)`` of a global rank: its place in its ep group, and the
        index of that ep group (its place in its expert-data-parallel group)."""
        pp_rank, _, tp_rank = self.coordinates(rank)
        edp_rank, ep_rank = divmod(self.folded_ranks(pp_rank, tp_rank).index(rank), self.ep_size)
        return ep_rank, edp_rank

    def ep_group(self, rank: int) -> list[int]:
        """The ranks that split the experts of ``rank``'s MoE layers, in ep-rank order."""
        pp_rank, _, tp_rank = self.coordinates(rank)
        _, edp_rank = self.ep_coordinates(rank)
        folded = self.folded_ranks(pp_rank, tp_rank)
        return folded[edp_rank * self.ep_size : (edp_rank + 1) * self.ep_size]

    def edp_group(self, rank: int) -> list[int]:
        """The ranks holding the same experts as ``rank`` (its expert gradients are
        reduced and its expert ZeRO state sharded over them), in edp-rank order."""
        pp_rank, _, tp_rank = self.coordinates(rank)
        ep_rank, _ = self.ep_coordinates(rank)
        return self.folded_ranks(pp_rank, tp_rank)[ep_rank :: self.ep_size]

    @property
    def ep_groups(self) -> list[list[int]]:
        """Every ep group, each once, in a fixed order (every rank creates them alike)."""
        return _unique(self.ep_group(r) for r in range(self.world_size))

    @property
    def edp_groups(self) -> list[list[int]]:
        """Every expert-data-parallel group, each once, in a fixed order."""
        return _unique(self.edp_group(r) for r in range(self.world_size))

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
        """The ranks as a pp x dp table (each cell the TP group's ranks when tp > 1)."""
        cells = [
            [",".join(str(r) for r in self.tp_group(p, d)) for d in range(self.dp_size)]
            for p in range(self.pp_size)
        ]
        width = max(len(str(self.world_size - 1)), *(len(c) for row in cells for c in row))
        label = f"pp_rank {{:>{len(str(self.world_size - 1))}}}: "
        tp = f" x {self.tp_size} (tp)" if self.tp_size > 1 else ""
        tp += f", ep {self.ep_size} folded into dp" if self.ep_size > 1 else ""
        named = f" ({self.order})" if self.placement != self.order else ""
        rows = [
            f"grid {self.pp_size} (pp) x {self.dp_size} (dp){tp}, {self.placement}{named}",
            "dp_rank:".ljust(len(label.format(0)))
            + " ".join(f"{d:>{width}}" for d in range(self.dp_size)),
        ]
        for p, row in enumerate(cells):
            rows.append(label.format(p) + " ".join(f"{c:>{width}}" for c in row))
        return "\n".join(rows)


def _unique(groups: Iterable[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for group in groups:
        if group not in out:
            out.append(group)
    return out


def make_grid(
    world_size: int,
    pp_size: int,
    placement: str = "cluster",
    tp_size: int = 1,
    ep_size: int = 1,
) -> Grid:
    """The grid of ``world_size`` ranks with ``pp_size`` pipeline stages each (and
    ``tp_size`` ranks per TP group, ``ep_size`` ranks per ep group folded into dp),
    laid out by ``placement``."""
    return Grid(world_size, pp_size, placement, tp_size, ep_size)
