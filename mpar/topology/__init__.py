"""The pipeline x data-parallel x context-parallel x tensor-parallel rank grid (pure: no
processes needed).

Each rank has coordinates ``(pp_rank, dp_rank, tp_rank, cp_rank)`` (a
:class:`Coordinates`; the context-parallel coordinate comes last so that code written
for the three-axis grid reads on). The placement (``placement_strategy``) orders the
four axes from outermost to innermost; the innermost varies fastest over consecutive
global ranks (one host's ranks), the outermost slowest::

    cluster = "DPCT" (default): rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
    spread  = "PDCT":           rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

``cluster`` puts one pipeline's stages on neighbouring ranks, ``spread`` one
data-parallel group's; both keep the TP group innermost (its ranks consecutive, on one
host) and the CP group right outside it (the next-busiest links). Any permutation of
the letters ``D``, ``P``, ``C``, ``T`` names the order directly, as SageMaker model
parallelism spells it; a permutation of ``D``, ``P``, ``T`` alone (the three-axis
spelling) puts ``C`` just outside ``T``::

    world 8, pp 2, tp 1, cp 1   cluster           spread
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
from typing import ClassVar, NamedTuple

from mpar.errors import ConfigError

__all__ = [
    "AXES",
    "PLACEMENT_NAMES",
    "Coordinates",
    "Grid",
    "GridShape",
    "make_grid",
    "placement_axes",
]


#: The named placements as axis letters, outermost first (``D`` data parallel, ``P``
#: pipeline, ``C`` context parallel, ``T`` tensor parallel): both keep the TP group's
#: ranks consecutive and the CP group next to it.
PLACEMENT_NAMES = {"cluster": "DPCT", "spread": "PDCT"}
_AXIS_OF_LETTER = {"P": "pp", "D": "dp", "C": "cp", "T": "tp"}
_LETTER_OF_AXIS = {axis: letter for letter, axis in _AXIS_OF_LETTER.items()}


def _letters(placement: object) -> str | None:
    """The four letters of ``placement``, or None when it names no order."""
    letters = PLACEMENT_NAMES.get(placement, placement) if isinstance(placement, str) else None
    if isinstance(letters, str) and sorted(letters) == ["D", "P", "T"]:
        return letters.replace("T", "CT")  # the three-axis spelling: C just outside T
    if isinstance(letters, str) and sorted(letters) == ["C", "D", "P", "T"]:
        return letters
    return None


def placement_axes(placement: object) -> tuple[str, str, str, str]:
    """The grid axes (``"pp"``, ``"dp"``, ``"cp"``, ``"tp"``) of a ``placement_strategy``
    value, outermost first: the last one varies fastest over consecutive global ranks.

    ``"cluster"`` is ``"DPCT"`` (one pipeline's stages on neighbouring ranks),
    ``"spread"`` is ``"PDCT"`` (one data-parallel group's ranks neighbouring); any
    permutation of ``D``, ``P``, ``C``, ``T`` names the order directly, as SageMaker model
    parallelism spells it, and a permutation of ``D``, ``P``, ``T`` puts ``C`` just
    outside ``T`` (``"TPD"`` is ``"CTPD"``: the TP group's ranks as far apart as possible).
    """
    letters = _letters(placement)
    if letters is None:
        raise ConfigError(
            f"config key 'placement_strategy' has value {placement!r}; allowed: 'cluster', "
            "'spread', or a permutation of the letters D (data parallel), P (pipeline), "
            "C (context parallel), T (tensor parallel) naming the axes outermost first, e.g. "
            "'DPCT' (= 'cluster'), 'PDCT' (= 'spread'), 'CTPD'; without C (e.g. 'TPD') the "
            "context-parallel axis goes just outside T"
        )
    a, b, c, d = (_AXIS_OF_LETTER[x] for x in letters)
    return a, b, c, d


AXES = ("pp", "dp", "cp", "tp")
"""The grid's axis names, outermost first (the ``DeviceMesh`` dimension names)."""


class Coordinates(NamedTuple):
    """A rank's place in the grid (context parallel last: see the module docstring)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


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
    cp: int = 1
    """Ranks that split each sequence (one context-parallel group)."""

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
    """The rank layout of a job: ``world_size = pp_size * dp_size * cp_size * tp_size``."""

    world_size: int
    pp_size: int
    placement: str = "cluster"
    """``"cluster"``, ``"spread"`` or a permutation of ``D``, ``P``, ``C``, ``T``
    (outermost first)."""
    tp_size: int = 1
    ep_size: int = 1
    """Ranks that split each MoE layer's experts, folded into dp (see the module)."""
    cp_size: int = 1
    axes: tuple[str, str, str, str] = field(init=False, repr=False, compare=False)
    """The axis names outermost first, from ``placement`` (``cluster``: dp, pp, cp, tp)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world_size < 1 or self.world_size % self.tp_size:
            raise ConfigError(
                f"tensor parallel degree {self.tp_size} must divide the world size "
                f"{self.world_size}"
            )
        if self.cp_size < 1 or (self.world_size // self.tp_size) % self.cp_size:
            raise ConfigError(
                f"context parallel degree {self.cp_size} must divide the world size "
                f"{self.world_size}"
                + (f" / tensor parallel degree {self.tp_size}" if self.tp_size > 1 else "")
            )
        inner = self.tp_size * self.cp_size
        if self.pp_size < 1 or (self.world_size // inner) % self.pp_size:
            raise ConfigError(
                f"pipeline degree {self.pp_size} must divide the world size {self.world_size}"
                + (f" / tensor parallel degree {self.tp_size}" if self.tp_size > 1 else "")
                + (f" / context parallel degree {self.cp_size}" if self.cp_size > 1 else "")
            )
        object.__setattr__(self, "axes", placement_axes(self.placement))
        if self.ep_size < 1 or self.dp_size % self.ep_size:
            raise ConfigError(
                f"expert parallel degree {self.ep_size} must divide the data-parallel "
                f"degree {self.dp_size} (expert parallelism folds into the dp ranks)"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.pp_size * self.cp_size * self.tp_size)

    @property
    def shape(self) -> GridShape:
        """The size of each axis."""
        return GridShape(
            pp=self.pp_size, dp=self.dp_size, tp=self.tp_size, ep=self.ep_size, cp=self.cp_size
        )

    def _sizes(self) -> dict[str, int]:
        return {"pp": self.pp_size, "dp": self.dp_size, "cp": self.cp_size, "tp": self.tp_size}

    @property
    def order(self) -> str:
        """The placement as axis letters, outermost first (``cluster``: ``"DPCT"``)."""
        return "".join(_LETTER_OF_AXIS[a] for a in self.axes)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """Global rank at grid coordinates ``(pp_rank, dp_rank, tp_rank, cp_rank)``."""
        coords = {"pp": pp_rank, "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}
        sizes, rank = self._sizes(), 0
        if not all(0 <= coords[a] < sizes[a] for a in AXES):
            raise ValueError(
                f"grid coordinates (pp {pp_rank}, dp {dp_rank}, tp {tp_rank}, cp {cp_rank}) "
                f"outside a {self.pp_size} (pp) x {self.dp_size} (dp) x {self.cp_size} (cp) x "
                f"{self.tp_size} (tp) grid"
            )
        for axis in self.axes:  # mixed radix, the outermost axis the most significant
            rank = rank * sizes[axis] + coords[axis]
        return rank

    def coordinates(self, rank: int) -> Coordinates:
        """``(pp_rank, dp_rank, tp_rank, cp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        coords: dict[str, int] = {}
        sizes = self._sizes()
        for axis in reversed(self.axes):  # the innermost axis is the least significant
            rank, coords[axis] = divmod(rank, sizes[axis])
        return Coordinates(coords["pp"], coords["dp"], coords["tp"], coords["cp"])

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of a global rank."""
        c = self.coordinates(rank)
        return c.pp, c.dp

    def pp_group(self, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> list[int]:
        """Ranks of one pipeline, in stage order."""
        return [self.rank_of(p, dp_rank, tp_rank, cp_rank) for p in range(self.pp_size)]

    def dp_group(self, pp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> list[int]:
        """Ranks holding the same pipeline stage and sequence piece, in data-parallel order."""
        return [self.rank_of(pp_rank, d, tp_rank, cp_rank) for d in range(self.dp_size)]

    def tp_group(self, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> list[int]:
        """Ranks that split the same layers (one batch), in tensor-parallel order."""
        return [self.rank_of(pp_rank, dp_rank, t, cp_rank) for t in range(self.tp_size)]

    def cp_group(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> list[int]:
        """Ranks that split the same sequences (one batch), in context-parallel order."""
        return [self.rank_of(pp_rank, dp_rank, tp_rank, c) for c in range(self.cp_size)]

    def dp_cp_group(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """Ranks holding the same parameters (same stage and TP piece): data parallel x
        context parallel, dp-major. Gradients are reduced, and ZeRO shards, over it."""
        return [
            self.rank_of(pp_rank, d, tp_rank, c)
            for d in range(self.dp_size)
            for c in range(self.cp_size)
        ]

    def _groups(self, key: str) -> list[list[int]]:
        """Every group along the axes of ``key`` (``"dp"``, or ``"dp_cp"``: both), one per
        combination of the other coordinates, in the order of those (pp, dp, tp, cp); its
        ranks in the order of ``key``'s coordinates."""
        axes = key.split("_")
        every = [self.coordinates(r) for r in range(self.world_size)]
        found: dict[tuple[int, ...], list[int]] = {}
        for rank, c in enumerate(every):
            rest = tuple(v for a, v in zip(Coordinates._fields, c) if a not in axes)
            found.setdefault(rest, []).append(rank)
        inside = [tuple(getattr(c, a) for a in axes) for c in every]
        return [sorted(found[k], key=lambda r: inside[r]) for k in sorted(found)]

    def folded_ranks(self, pp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> list[int]:
        """The ranks expert parallelism folds into, in order: the data-parallel group
        of ``(pp_rank, tp_rank, cp_rank)`` (the one place to widen to dp x cp once ep
        and cp may be combined; the config refuses both > 1 for now)."""
        return self.dp_group(pp_rank, tp_rank, cp_rank)

    def ep_coordinates(self, rank: int) -> tuple[int, int]:
        """``(ep_rank, edp_rank)`` of a global rank: its place in its ep group, and the
        index of that ep group (its place in its expert-data-parallel group)."""
        c = self.coordinates(rank)
        edp_rank, ep_rank = divmod(self.folded_ranks(c.pp, c.tp, c.cp).index(rank), self.ep_size)
        return ep_rank, edp_rank

    def ep_group(self, rank: int) -> list[int]:
        """The ranks that split the experts of ``rank``'s MoE layers, in ep-rank order."""
        c = self.coordinates(rank)
        _, edp_rank = self.ep_coordinates(rank)
        folded = self.folded_ranks(c.pp, c.tp, c.cp)
        return folded[edp_rank * self.ep_size : (edp_rank + 1) * self.ep_size]

    def edp_group(self, rank: int) -> list[int]:
        """The ranks holding the same experts as ``rank`` (its expert gradients are
        reduced and its expert ZeRO state sharded over them), in edp-rank order."""
        c = self.coordinates(rank)
        ep_rank, _ = self.ep_coordinates(rank)
        return self.folded_ranks(c.pp, c.tp, c.cp)[ep_rank :: self.ep_size]

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
        return self._groups("pp")

    @property
    def dp_groups(self) -> list[list[int]]:
        return self._groups("dp")

    @property
    def tp_groups(self) -> list[list[int]]:
        return self._groups("tp")

    @property
    def cp_groups(self) -> list[list[int]]:
        return self._groups("cp")

    @property
    def dp_cp_groups(self) -> list[list[int]]:
        return self._groups("dp_cp")

    def mesh(self) -> list[list[list[list[int]]]]:
        """The global ranks indexed ``[pp_rank][dp_rank][cp_rank][tp_rank]`` (a
        DeviceMesh's layout over :data:`AXES`)."""
        return [
            [[self.tp_group(p, d, c) for c in range(self.cp_size)] for d in range(self.dp_size)]
            for p in range(self.pp_size)
        ]

    def __str__(self) -> str:
        """The ranks as a pp x dp table (each cell the CP x TP ranks when cp or tp > 1)."""
        cells = [
            [
                ",".join(str(r) for c in range(self.cp_size) for r in self.tp_group(p, d, c))
                for d in range(self.dp_size)
            ]
            for p in range(self.pp_size)
        ]
        width = max(len(str(self.world_size - 1)), *(len(c) for row in cells for c in row))
        label = f"pp_rank {{:>{len(str(self.world_size - 1))}}}: "
        cp = f" x {self.cp_size} (cp)" if self.cp_size > 1 else ""
        tp = f" x {self.tp_size} (tp)" if self.tp_size > 1 else ""
        tp += f", ep {self.ep_size} folded into dp" if self.ep_size > 1 else ""
        named = f" ({self.order})" if self.placement != self.order else ""
        rows = [
            f"grid {self.pp_size} (pp) x {self.dp_size} (dp){cp}{tp}, {self.placement}{named}",
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
    cp_size: int = 1,
) -> Grid:
    """The grid of ``world_size`` ranks with ``pp_size`` pipeline stages each (and
    ``tp_size`` ranks per TP group, ``ep_size`` ranks per ep group folded into dp,
    ``cp_size`` per CP group), laid out by ``placement``."""
    return Grid(world_size, pp_size, placement, tp_size, ep_size=ep_size, cp_size=cp_size)
