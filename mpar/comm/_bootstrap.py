"""``mpar.init`` / ``mpar.shutdown``: process groups, device, threads.

The single mutable global of mpar is the :class:`State` held here; every other
package asks :func:`state` for it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mpar import _device
from mpar.comm import _abort, _watchdog
from mpar.comm._consistency import check_same_config
from mpar.comm._layout import Layout, detect_layout
from mpar.comm._progress import PROGRESS, RECENT
from mpar.comm._watchdog import transport_timeout
from mpar.config import Config, load_config
from mpar.errors import AlreadyInitializedError, ConfigError, NotInitializedError
from mpar.topology import Grid

__all__ = ["State", "init", "is_initialized", "on_shutdown", "shutdown", "state"]


@dataclass
class State:
    """Everything ``mpar.init`` decided, for this process."""

    config: Config
    layout: Layout
    grid: Grid
    device: torch.device
    backend: str
    pp_rank: int
    dp_rank: int
    pp_ranks: list[int]
    """Global ranks of this rank's pipeline, in stage order."""
    dp_ranks: list[int]
    """Global ranks of this rank's data-parallel group."""
    pp_group: Any = None
    dp_group: Any = None
    owns_process_group: bool = True
    extras: dict[str, Any] = field(default_factory=dict)


_STATE: State | None = None
_SHUTDOWN_HOOKS: list[Callable[[], None]] = []
_STORE: tuple[Any, dist.Store] | None = None
"""(what identifies the rendezvous, the store) kept for the process's lifetime."""
_GENERATION = 0


def on_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook()`` at the start of every ``shutdown`` while the process groups still
    exist (a pending asynchronous checkpoint finishes there). Registered once."""
    if hook not in _SHUTDOWN_HOOKS:
        _SHUTDOWN_HOOKS.append(hook)


def state() -> State:
    """The state of the current ``mpar.init``; a clear error before it."""
    if _STATE is None:
        raise NotInitializedError("mpar is not initialised: call mpar.init(config) first")
    return _STATE


def is_initialized() -> bool:
    return _STATE is not None


def _pick_backend(config: Config, device: torch.device) -> str:
    if config.backend == "auto":
        return _device.default_backend(device, config.pipeline_parallel_degree)
    _device.check_backend(device, config.backend)
    return config.backend


def _set_threads(layout: Layout) -> None:
    """Give each rank its share of the host's cores unless the user chose."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, layout.local_size)))


def _init_process_group(layout: Layout, backend: str, timeout: datetime.timedelta) -> bool:
    if dist.is_initialized():
        if dist.get_world_size() != layout.world_size:
            raise ConfigError(
                f"a torch.distributed process group of size {dist.get_world_size()} exists, "
                f"but the launcher reports {layout.world_size} processes"
            )
        return False
    store, generation = _rendezvous_store(layout, timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"mpar/{generation}", store),
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    return True


def _rendezvous_store(layout: Layout, timeout: datetime.timedelta) -> tuple[dist.Store, int]:
    """The job's key-value store, made once per process, and this ``init``'s generation.

    ``init`` after ``shutdown`` (same processes, a new config) rendezvouses in
    the same store under a fresh prefix. A new store on the same port would
    race: a rank that starts its next ``init`` early could reach the previous
    store (still served by a slower rank 0) or read its stale addresses.
    Every rank calls ``init`` the same number of times, so generations agree.
    """
    global _STORE, _GENERATION
    key = (layout.source, layout.master_addr, layout.master_port, layout.world_size)
    if _STORE is None or _STORE[0] != key:
        if layout.source == "single":
            store: dist.Store = dist.HashStore()
        elif layout.source == "torchrun":  # env:// also finds torchrun's agent-hosted store
            store, _, _ = next(
                dist.rendezvous("env://", layout.rank, layout.world_size, timeout=timeout)
            )
        else:
            store = dist.TCPStore(
                layout.master_addr,
                layout.master_port,
                layout.world_size,
                is_master=layout.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
        _STORE, _GENERATION = (key, store), 0
    _GENERATION += 1
    return _STORE[1], _GENERATION


def _make_groups(
    grid: Grid, rank: int, backends: tuple[str, str], timeout: datetime.timedelta
) -> tuple[Any, Any]:
    """Create every pipeline group and every data-parallel group (``backends``: the
    pipeline groups', the data-parallel groups'); return this rank's."""
    mine_pp = mine_dp = None
    # Every rank must create every group, in the same order. A group of every rank
    # is created as such (ranks None), as torch_xla's process group requires.
    for ranks in grid.pp_groups:
        group = dist.new_group(_members(ranks, grid), timeout=timeout, backend=backends[0])
        if rank in ranks:
            mine_pp = group
    for ranks in grid.dp_groups:
        group = dist.new_group(_members(ranks, grid), timeout=timeout, backend=backends[1])
        if rank in ranks:
            mine_dp = group
    return mine_pp, mine_dp


def _checked_same_config(config: Config, world_size: int, owns: bool) -> None:
    try:
        check_same_config(config, world_size)
    except ConfigError:
        if owns:  # leave this process as it was, so that init can be called again
            dist.destroy_process_group()
        raise


def _members(ranks: list[int], grid: Grid) -> list[int] | None:
    return None if len(ranks) == grid.world_size else ranks


def init(config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Config:
    """Start mpar in this process; returns the resolved configuration.

    ``config`` is a dict, a JSON/YAML path or None (then ``MPAR_CONFIG``, then
    defaults). The process layout comes from torchrun's variables, MPI
    (mpi4py) or SLURM; with none of them mpar runs as a single process. The
    whole configuration is checked before any process group is created.
    """
    global _STATE, _EXIT_HOOKED
    if _STATE is not None:
        raise AlreadyInitializedError(
            "mpar.init() was already called in this process; call mpar.shutdown() before "
            "initialising again"
        )
    resolved = load_config(config)
    layout = detect_layout()
    resolved.check_world_size(layout.world_size)
    grid = Grid(layout.world_size, resolved.pipeline_parallel_degree, resolved.placement_strategy)
    device = _device.pick_device(resolved.device, layout.local_rank)
    backend = _pick_backend(resolved, device)
    _set_threads(layout)
    timeout = transport_timeout(resolved.timeout_s)  # the hang watchdog reports first
    world_backend, dp_backend = _device.group_backends(backend)
    owns = _init_process_group(layout, world_backend, timeout)
    _checked_same_config(resolved, layout.world_size, owns)
    pp_group, dp_group = _make_groups(grid, layout.rank, (world_backend, dp_backend), timeout)
    pp_rank, dp_rank = grid.coords(layout.rank)
    torch.manual_seed(resolved.seed)
    PROGRESS.reset(RECENT if resolved.trace is None else 16 * RECENT)
    if layout.world_size > 1:
        _abort.start_watcher(
            layout.master_addr, layout.master_port, layout.rank, resolved.timeout_s
        )
        _watchdog.start(layout, resolved.timeout_s, resolved.trace)
    _STATE = State(
        config=resolved,
        layout=layout,
        grid=grid,
        device=device,
        backend=backend,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        pp_ranks=grid.pp_group(dp_rank),
        dp_ranks=grid.dp_group(pp_rank),
        pp_group=pp_group,
        dp_group=dp_group,
        owns_process_group=owns,
    )
    if not _EXIT_HOOKED:
        atexit.register(_shutdown_at_exit)
        _EXIT_HOOKED = True
    return resolved


_EXIT_HOOKED = False


def _shutdown_at_exit() -> None:
    """``shutdown()`` for a script that did not call it: the process group's threads
    must stop before the interpreter's static destructors run, or the process aborts
    at exit ("terminate called without an active exception", SIGABRT) after its work
    is done."""
    with contextlib.suppress(BaseException):  # nothing may fail at exit
        shutdown()


def shutdown() -> None:
    """Tear down what ``init`` created; ``init`` may then be called again."""
    global _STATE
    if _STATE is None:
        return
    for hook in list(_SHUTDOWN_HOOKS):
        hook()
    current, _STATE = _STATE, None
    _abort.stop_watcher()
    _watchdog.stop()
    if current.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
