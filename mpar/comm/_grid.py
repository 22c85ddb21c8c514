"""This rank's place in the job's rank grid, with the process groups along each axis.

``mpar.init`` builds one :class:`ProcessGrid` and hands it to whoever talks to
other ranks (the runtime, sharding, checkpoints, the collectives here), the way
torchtitan passes its ``ParallelDims``: nothing looks a global up to learn its
peers. The pure layout (which global rank sits at which coordinates) is
:class:`mpar.topology.Grid`; this object adds the processes.

The groups come from torch's ``DeviceMesh`` over the axes ``("pp", "dp", "cp", "tp")``
(in that order whatever the placement), so DTensor-based code
can take :attr:`ProcessGrid.mesh` as is. The data-parallel x context-parallel group
(the ranks that hold the same parameters, over which gradients are reduced and ZeRO
shards) is one more group, made with ``new_group``; at cp 1 it is the dp group. Where a ``DeviceMesh`` cannot carry
mpar's groups, they are made with ``new_group`` (same ranks, same order) and
``mesh`` is None:

- the MPI backend, whose process groups take no options (no timeout);
- the XLA backend, where ``DeviceMesh`` makes no process groups at all.

A process group the user created before ``mpar.init`` serves as the world group
either way: the mesh's groups are new groups inside it.

Expert parallelism folds into the data-parallel ranks (:mod:`mpar.topology`): its ep
and expert-data-parallel groups are made with ``new_group`` beside the mesh, only
where they have more than one rank.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mpar import _device
from mpar._compat import DeviceMesh, backend_options
from mpar.topology import AXES, Grid

__all__ = ["ProcessGrid", "build_process_grid"]


@dataclass(frozen=True)
class ProcessGrid:
    """This rank's coordinates in the pp x dp x cp x tp grid and its groups along each axis."""

    topology: Grid
    """The pure layout: every rank's coordinates."""
    rank: int
    """This process's global rank."""
    pp_group: dist.ProcessGroup
    """The ranks of this rank's pipeline (same dp and tp coordinates), in stage order."""
    dp_group: dist.ProcessGroup
    """The ranks that hold the same stage (same pp and tp coordinates)."""
    tp_group: dist.ProcessGroup
    """The ranks that split the same layers (same pp, dp and cp coordinates)."""
    mesh: DeviceMesh | None
    """torch's mesh over :data:`~mpar.topology.AXES`, or None (MPI, XLA; see the module)."""
    timeout: datetime.timedelta
    """The groups' transport timeout (a new group gets the same)."""
    cp_group: dist.ProcessGroup
    """The ranks that split the same sequences (same pp, dp and tp coordinates)."""
    dp_cp_group: dist.ProcessGroup
    """The ranks that hold the same parameters (same pp and tp coordinates): data
    parallel x context parallel. Gradients are summed, and ZeRO shards, over it."""
    ep_group: dist.ProcessGroup | None = None
    """The ranks that split this rank's experts (None when ``ep_size`` is 1)."""
    edp_group: dist.ProcessGroup | None = None
    """The ranks holding this rank's experts (the dp group when ``ep_size`` is 1; None
    when it has one rank)."""
    _made: dict[str, dist.ProcessGroup] = field(default_factory=dict, compare=False, repr=False)
    """Groups over every rank made on first use, by backend (:meth:`world_group`)."""

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def pp_size(self) -> int:
        return self.topology.pp_size

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size

    @property
    def cp_size(self) -> int:
        return self.topology.cp_size

    @property
    def dp_cp_size(self) -> int:
        """Ranks holding the same parameters: dp x cp."""
        return self.topology.dp_size * self.topology.cp_size

    @property
    def pp_rank(self) -> int:
        return self.topology.coordinates(self.rank).pp

    @property
    def dp_rank(self) -> int:
        return self.topology.coordinates(self.rank).dp

    @property
    def tp_rank(self) -> int:
        return self.topology.coordinates(self.rank).tp

    @property
    def cp_rank(self) -> int:
        return self.topology.coordinates(self.rank).cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in :attr:`dp_cp_ranks` (dp-major)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, in stage order."""
        return self.topology.pp_group(self.dp_rank, self.tp_rank, self.cp_rank)

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return self.topology.dp_group(self.pp_rank, self.tp_rank, self.cp_rank)

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group."""
        return self.topology.tp_group(self.pp_rank, self.dp_rank, self.cp_rank)

    @property
    def ep_size(self) -> int:
        return self.topology.ep_size

    @property
    def ep_rank(self) -> int:
        return self.topology.ep_coordinates(self.rank)[0]

    @property
    def edp_size(self) -> int:
        """Ranks holding the same experts: ``dp_size / ep_size``."""
        return self.dp_size // self.ep_size

    @property
    def edp_rank(self) -> int:
        return self.topology.ep_coordinates(self.rank)[1]

    @property
    def ep_ranks(self) -> list[int]:
        """Global ranks of this rank's ep group, in ep-rank order."""
        return self.topology.ep_group(self.rank)

    @property
    def edp_ranks(self) -> list[int]:
        """Global ranks of this rank's expert-data-parallel group, in edp-rank order."""
        return self.topology.edp_group(self.rank)

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's context-parallel group, in CP rank order."""
        return self.topology.cp_group(self.pp_rank, self.dp_rank, self.tp_rank)

    @property
    def dp_cp_ranks(self) -> list[int]:
        """Global ranks holding this rank's parameters (dp x cp, dp-major)."""
        return self.topology.dp_cp_group(self.pp_rank, self.tp_rank)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """Global rank at grid coordinates ``(pp_rank, dp_rank, tp_rank, cp_rank)``."""
        return self.topology.rank_of(pp_rank, dp_rank, tp_rank, cp_rank)

    def world_group(self, backend: str) -> dist.ProcessGroup:
        """A group of every rank on ``backend``, made at the first call (collective then:
        every rank calls it) and kept with the grid (checkpoints use a gloo one)."""
        if backend not in self._made:
            ranks = list(range(self.world_size))
            self._made[backend] = dist.new_group(ranks, timeout=self.timeout, backend=backend)
        return self._made[backend]

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        """A process group over ``ranks`` with the grid's timeout (every rank must call
        this, in the same order)."""
        return dist.new_group(sorted(ranks), timeout=self.timeout)


def _options(backend: str, timeout: datetime.timedelta) -> Any:
    """``backend``'s process-group options carrying ``timeout`` (a DeviceMesh takes no
    timeout of its own)."""
    return backend_options(backend, timeout)


def _with_mesh(
    topology: Grid, rank: int, backends: tuple[str, str], timeout: datetime.timedelta
) -> ProcessGrid:
    pipeline, data = backends
    mesh = DeviceMesh(
        _device.mesh_device_type(data) or "cpu",
        torch.tensor(topology.mesh(), dtype=torch.int),
        mesh_dim_names=AXES,
        backend_override=tuple(
            (name, _options(name, timeout)) for name in (pipeline, data, data, data)
        ),
    )
    pp, dp, cp, tp = (mesh.get_group(axis) for axis in AXES)
    dp_cp = _dp_cp_group(topology, rank, dp, data, timeout)
    return ProcessGrid(topology, rank, pp, dp, tp, mesh, timeout, cp, dp_cp)


def _dp_cp_group(
    topology: Grid,
    rank: int,
    dp: dist.ProcessGroup,
    backend: str,
    timeout: datetime.timedelta,
) -> dist.ProcessGroup:
    """This rank's dp x cp group: the dp group at cp 1, else one new group per (pp, tp),
    made by every rank in the same order."""
    if topology.cp_size == 1:
        return dp
    found = None
    for ranks in topology.dp_cp_groups:
        members = None if len(ranks) == topology.world_size else ranks
        group = dist.new_group(members, timeout=timeout, backend=backend)
        if rank in ranks:
            found = group
    if found is None:
        raise ValueError(f"rank {rank} is in no dp x cp group of {topology}")
    return found


def _with_new_groups(
    topology: Grid, rank: int, backends: tuple[str, str], timeout: datetime.timedelta
) -> ProcessGrid:
    """Every group of every axis, made by every rank in the same order; this rank's kept.
    A group of every rank is created as such (ranks None), as the XLA process group requires."""
    mine: list[dist.ProcessGroup] = []
    axes = (
        (topology.pp_groups, backends[0]),
        (topology.dp_groups, backends[1]),
        (topology.tp_groups, backends[1]),
        (topology.cp_groups, backends[1]),
    )
    for groups, backend in axes:
        found = None
        for ranks in groups:
            members = None if len(ranks) == topology.world_size else ranks
            group = dist.new_group(members, timeout=timeout, backend=backend)
            if rank in ranks:
                found = group
        if found is None:
            raise ValueError(f"rank {rank} is in no group of {topology}")
        mine.append(found)
    dp_cp = _dp_cp_group(topology, rank, mine[1], backends[1], timeout)
    return ProcessGrid(topology, rank, mine[0], mine[1], mine[2], None, timeout, mine[3], dp_cp)


def _expert_groups(
    grid: ProcessGrid, backend: str
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's ep and expert-data-parallel groups: every group of more than one
    rank made by every rank, in the topology's order."""
    topology, timeout = grid.topology, grid.timeout
    if topology.ep_size == 1:
        return None, grid.dp_group
    found: list[dist.ProcessGroup | None] = [None, None]
    for i, groups in enumerate((topology.ep_groups, topology.edp_groups)):
        for ranks in groups:
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if grid.rank in ranks:
                found[i] = group
    return found[0], found[1]


def build_process_grid(
    topology: Grid, rank: int, backends: tuple[str, str], timeout: datetime.timedelta
) -> ProcessGrid:
    """The process groups of ``topology`` for global ``rank`` (collective: every rank
    calls it). ``backends``: the pipeline groups' and the data-parallel (and tp, ep, cp)
    groups'."""
    if _device.mesh_device_type(backends[1]) is not None and len(set(backends)) == 1:
        grid = _with_mesh(topology, rank, backends, timeout)
    else:
        grid = _with_new_groups(topology, rank, backends, timeout)
    ep, edp = _expert_groups(grid, backends[1])
    return dataclasses.replace(grid, ep_group=ep, edp_group=edp)
