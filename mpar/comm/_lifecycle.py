"""``mpar.init`` / ``mpar.shutdown``: process groups, device, threads.

What an ``init`` decided is the :class:`Session` held here: the :class:`State` a step
gets (read-only; a model holds its own, with its resolved config) and what the process
keeps beside it. Only the public entry points (``DistributedModel``,
``DistributedOptimizer``, the rank helpers, ``mpar.barrier``) ask :func:`state` or
:func:`session` for it; they pass the state, or its :class:`~mpar.comm.ProcessGrid`,
to the code below them. Every other piece of module-level process state is listed
in :mod:`mpar.comm._process_state`; ``shutdown`` resets them all.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from mpar import _device
from mpar.comm import _abort, _process_state, _watchdog
from mpar.comm._consistency import check_same_config
from mpar.comm._cp_ops import CP_GROUP, clear_cp_groups, cp_groups_cleared, register_cp_group
from mpar.comm._ep_ops import (
    BATCH_GROUP,
    EP_GROUP,
    TRAFFIC,
    clear_ep_groups,
    ep_groups_cleared,
    register_ep_group,
)
from mpar.comm._grid import ProcessGrid, build_process_grid
from mpar.comm._nccl_rules import NcclRules
from mpar.comm._p2p import Links
from mpar.comm._process_layout import Layout, detect_layout
from mpar.comm._progress import PROGRESS, RECENT, Waiting
from mpar.comm._shared import SharedMemory, connect, sweep
from mpar.comm._tp_ops import TP_GROUP, clear_tp_groups, register_tp_group, tp_groups_cleared
from mpar.comm._watchdog import transport_timeout
from mpar.config import Config, load_config
from mpar.errors import AlreadyInitializedError, ConfigError, NotInitializedError
from mpar.topology import Grid

__all__ = [
    "Session",
    "State",
    "init",
    "is_initialized",
    "session",
    "shutdown",
    "state",
]


@dataclass(frozen=True)
class State:
    """What a step needs from ``mpar.init``: one typed, read-only object.

    ``mpar.init`` makes the process's; a model whose ``"auto"`` keys were resolved holds
    one of its own (:meth:`with_config`), made when its config changes, never per step.
    Nothing is written on it: what changes while mpar runs lives in objects it refers
    to (the point-to-point streams in ``p2p_links``, process groups made on first use
    in ``grid``), shared by every model of the process.
    """

    config: Config
    layout: Layout
    grid: ProcessGrid
    """The rank grid and its process groups (passed to whoever needs them)."""
    device: torch.device
    backend: str
    p2p_links: Links = field(default_factory=Links)
    """Point-to-point streams kept open across steps (pipeline transfers)."""

    def with_config(self, config: Config) -> State:
        """This state with another config (a model's, its ``"auto"`` keys resolved)."""
        return self if config is self.config else dataclasses.replace(self, config=config)


@dataclass(eq=False)
class Session:
    """One ``mpar.init`` of this process: its :class:`State` and what the process keeps
    beside it until ``mpar.shutdown``."""

    state: State
    owns_process_group: bool = True
    """Whether ``init`` created the default process group (``shutdown`` destroys it)."""
    models: weakref.WeakSet[object] = field(default_factory=weakref.WeakSet)
    """The ``DistributedModel`` objects of this ``init`` (``memory_report`` sums them)."""
    optimizers: weakref.WeakSet[object] = field(default_factory=weakref.WeakSet)
    """The ``DistributedOptimizer`` objects of this ``init`` (``memory_report``)."""


_SESSION: Session | None = None
_STORE: tuple[tuple[str, str, int, int], dist.Store] | None = None
"""(what identifies the rendezvous, the store) kept for the process's lifetime."""
_GENERATION = 0
"""``init`` calls so far in this process (kept: see :func:`_rendezvous_store`)."""
_EXIT_HOOKED = False
"""Whether ``shutdown`` runs at exit and uncaught exceptions mark this rank failed."""


def session() -> Session:
    """The current ``mpar.init``; a clear error before it."""
    if _SESSION is None:
        raise NotInitializedError("mpar is not initialised: call mpar.init(config) first")
    return _SESSION


def state() -> State:
    """The state of the current ``mpar.init``; a clear error before it."""
    return session().state


def is_initialized() -> bool:
    return _SESSION is not None


_BUILT_WITH = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
               "mpi": dist.is_mpi_available}  # fmt: skip
"""Backends a torch build may lack; torch itself says so only inside init_process_group."""


def _pick_backend(config: Config, device: torch.device) -> str:
    if config.backend == "auto":
        return _device.default_backend(device, config.pipeline_parallel_degree)
    _device.check_backend(device, config.backend)
    built = _BUILT_WITH.get(config.backend)
    if built is not None and not built():
        mpi = " (ranks started by mpirun or `mpar launch --mpi` need no MPI backend)"
        raise ConfigError(
            f"config key 'backend' is {config.backend!r} but this torch build has no "
            f"{config.backend.upper()} support (torch.distributed.is_{config.backend}_available() "
            "is False); use backend 'auto' (gloo on the CPU, nccl on CUDA)"
            + (mpi if config.backend == "mpi" else "")
        )
    return config.backend


def _init_process_group(
    layout: Layout, backend: str, timeout: datetime.timedelta, generation: int
) -> bool:
    if dist.is_initialized():
        if dist.get_world_size() != layout.world_size:
            raise ConfigError(
                f"a torch.distributed process group of size {dist.get_world_size()} exists, "
                f"but the launcher reports {layout.world_size} processes"
            )
        return False
    store = dist.PrefixStore(f"mpar/{generation}", _rendezvous_store(layout, timeout))
    if layout.source == "torchrun" and not layout.agent_store:
        _agree_world_size(store, layout, timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    return True


def _rendezvous_store(layout: Layout, timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store, made once per process.

    ``init`` after ``shutdown`` (same processes, a new config) rendezvouses in
    the same store under a fresh prefix, its generation. A new store on the same port
    would race: a rank that starts its next ``init`` early could reach the previous
    store (still served by a slower rank 0) or read its stale addresses.
    Every rank calls ``init`` the same number of times, so generations agree.
    """
    global _STORE
    key = (layout.source, layout.master_addr, layout.master_port, layout.world_size)
    if _STORE is None or _STORE[0] != key:
        if layout.world_size == 1:  # alone (RANK=0 WORLD_SIZE=1 too): nobody to meet
            store: dist.Store = dist.HashStore()
        elif layout.agent_store:  # torchrun's agent hosts it: env:// connects to it
            store, _, _ = next(
                dist.rendezvous("env://", layout.rank, layout.world_size, timeout=timeout)
            )
        else:  # rank 0 hosts it, and waits for nobody here (see _agree_world_size)
            store = dist.TCPStore(
                layout.master_addr,
                layout.master_port,
                layout.world_size,
                is_master=layout.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
                multi_tenant=layout.source == "torchrun",  # as env:// makes it
            )
        _STORE = (key, store)
    return _STORE[1]


def _agree_world_size(store: dist.Store, layout: Layout, timeout: datetime.timedelta) -> None:
    """Fail at once where the ranks were given different world sizes (``WORLD_SIZE`` set
    by hand), instead of waiting for processes that do not exist until the timeout.

    Each rank posts its world size; rank 0 compares those of the ranks it expects, the
    others compare rank 0's (and say they have read it). Every rank that disagrees with
    rank 0 fails, and so does rank 0, at the first rank that disagrees, once that rank
    has read its value: rank 0 hosts the store, which ends with its process.
    """
    store.set(f"world_size/{layout.rank}", str(layout.world_size))
    if layout.rank != 0:
        theirs = int(store.get("world_size/0"))  # waits for the key
        store.set(f"world_size_read/{layout.rank}", "1")
        if theirs != layout.world_size:
            raise _world_size_error(layout, 0, theirs)
        return
    for peer in range(1, layout.world_size):
        theirs = int(store.get(f"world_size/{peer}"))
        if theirs != layout.world_size:
            with contextlib.suppress(RuntimeError):  # DistError: the peer is gone
                store.wait([f"world_size_read/{peer}"], min(timeout, _READ_GRACE))
            raise _world_size_error(layout, peer, theirs)


_READ_GRACE = datetime.timedelta(seconds=30)
"""How long rank 0 lets a rank that disagrees read its world size before ending."""


def _world_size_error(layout: Layout, peer: int, theirs: int) -> ConfigError:
    return ConfigError(
        f"rank {layout.rank} was started with WORLD_SIZE={layout.world_size} but rank "
        f"{peer} with WORLD_SIZE={theirs}: every process of a job must be given the "
        "same world size (and ranks 0 to WORLD_SIZE - 1 once each); start them with "
        "one launcher (`mpar launch`, torchrun) or fix the variables"
    )


def _checked_same_config(config: Config, world_size: int, owns: bool) -> None:
    try:
        check_same_config(config, world_size)
    except ConfigError:
        if owns:  # leave this process as it was, so that init can be called again
            dist.destroy_process_group()
        raise


def _check_device_memory(config: Config, device: torch.device) -> None:
    """ "auto" keys need the memory per rank: the config's, else the device's own (CUDA)."""
    if config.auto_keys and config.device_memory is None and _device.total_memory(device) is None:
        raise ConfigError(
            f"config keys {list(config.auto_keys)} are 'auto' but 'device_memory' is not set "
            f"and the {device.type} device does not report its memory; the planner needs the "
            'memory per rank, e.g. "device_memory": "16GiB"'
        )


def _check_world_size(config: Config, world_size: int) -> None:
    """``config.check_world_size``; a script started as one process (``python train.py``
    with a pipeline in its config) is told how to start it on several."""
    try:
        config.check_world_size(world_size)
    except ConfigError as error:
        if world_size != 1 or "pipeline_parallel_degree" in config.auto_keys:
            raise
        needed = (
            config.pipeline_parallel_degree
            * config.context_parallel_degree
            * config.tensor_parallel_degree
        )
        raise ConfigError(
            f"{error}. This process runs alone: start the script on {needed} processes or a "
            f"multiple, e.g. `mpar launch --nproc-per-node {needed} script.py` (or torchrun, "
            "mpirun, srun)"
        ) from None


def init(config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Config:
    """Start mpar in this process; returns the resolved configuration.

    ``config`` is a dict, a JSON/YAML path or None (then ``MPAR_CONFIG``, then
    defaults). The process layout comes from torchrun's variables, MPI
    (mpi4py) or SLURM; with none of them mpar runs as a single process. The
    whole configuration is checked before any process group is created.
    """
    global _SESSION, _EXIT_HOOKED, _GENERATION
    if _SESSION is not None:
        raise AlreadyInitializedError(
            "mpar.init() was already called in this process; call mpar.shutdown() before "
            "initialising again"
        )
    resolved = load_config(config)
    layout = detect_layout()
    _check_world_size(resolved, layout.world_size)
    topology = Grid(
        layout.world_size,
        resolved.pipeline_parallel_degree,
        resolved.placement_strategy,
        resolved.tensor_parallel_degree,
        ep_size=resolved.expert_parallel_degree,
        cp_size=resolved.context_parallel_degree,
    )
    device = _device.pick_device(resolved.device, layout.local_rank)
    _check_device_memory(resolved, device)
    backend = _pick_backend(resolved, device)
    _device.check_ranks_per_device(device, backend, layout.local_size)
    _device.set_threads(layout.local_size)
    timeout = transport_timeout(resolved.timeout_s)  # the hang watchdog reports first
    world_backend, dp_backend = _device.group_backends(backend)
    _GENERATION += 1
    owns = _init_process_group(layout, world_backend, timeout, _GENERATION)
    _checked_same_config(resolved, layout.world_size, owns)
    grid = build_process_grid(topology, layout.rank, (world_backend, dp_backend), timeout)
    register_tp_group(TP_GROUP, grid.tp_group, grid.tp_size, grid.tp_rank)
    register_ep_group(EP_GROUP, grid.ep_group, grid.ep_size, grid.ep_rank)
    register_ep_group(BATCH_GROUP, grid.dp_group, grid.dp_size, grid.dp_rank)
    torch.manual_seed(resolved.seed)
    PROGRESS.reset(RECENT if resolved.trace is None else 16 * RECENT)
    if layout.world_size > 1:
        _abort.start_watcher(
            layout.master_addr, layout.master_port, layout.rank, resolved.timeout_s
        )
        _watchdog.start(layout, resolved.timeout_s, resolved.trace, _GENERATION)
    st = State(config=resolved, layout=layout, grid=grid, device=device, backend=backend)
    st.p2p_links.rules = _nccl_rules(st, world_backend)
    rules = st.p2p_links.rules  # the ring's exchanges obey NCCL's rules under it too
    register_cp_group(CP_GROUP, grid.cp_group, grid.cp_size, grid.cp_rank, grid.cp_ranks, rules)
    st.p2p_links.shared = _shared_memory(st, world_backend)
    _SESSION = Session(st, owns_process_group=owns)
    if not _EXIT_HOOKED:
        atexit.register(_shutdown_at_exit)
        sys.excepthook = _mark_failed
        _EXIT_HOOKED = True
    return resolved


def _nccl_rules(st: State, world_backend: str) -> NcclRules | None:
    """The NCCL-rules test transport (config key ``nccl_rules``), on a gloo group of its
    own over every rank (collective: every rank makes it)."""
    if not st.config.nccl_rules or st.layout.world_size == 1:
        return None
    if world_backend != "gloo":
        raise ConfigError(
            f"config key 'nccl_rules' needs the gloo backend, but this job runs on "
            f"{world_backend!r}; set backend 'gloo' (or drop 'nccl_rules')"
        )
    group = dist.new_group(backend="gloo", timeout=st.grid.timeout)
    return NcclRules(group, st.layout.rank, st.layout.world_size)


def _shared_memory(st: State, world_backend: str) -> SharedMemory | None:
    """Shared-memory rings for the pipeline transfers between ranks of one host, when
    the transfers travel through host memory over gloo and the config allows them.
    First, on each host, the ring files that killed jobs left behind are removed."""
    if st.layout.local_rank == 0:
        sweep()  # the files of killed jobs on this host
    wire = _device.p2p_device(st.device, st.backend)
    if not (
        st.config.shared_memory
        and not st.config.nccl_rules
        and st.grid.pp_size > 1
        and world_backend == "gloo"
        and _device.is_host(wire)
    ):
        return None
    with Waiting(("collective", "shared-memory setup (in mpar.init)", None)):
        return connect(st.layout.rank, st.grid.pp_ranks, st.layout.local_size, group=None)


def _shutdown_at_exit() -> None:
    """``shutdown()`` for a script that did not call it: the process group's threads
    must stop before the interpreter's static destructors run, or the process aborts
    at exit ("terminate called without an active exception", SIGABRT) after its work
    is done."""
    global _EXIT_HOOKED
    _EXIT_HOOKED = False  # running now: nothing to unregister
    with contextlib.suppress(BaseException):  # nothing may fail at exit
        shutdown()


def _final_barrier(current: State) -> None:
    """Every rank waits for the others before tearing down, watched by the hang
    watchdog: a rank that never comes (stuck after its last step, or gone early
    with ``sys.exit``) is named with its stack within ``timeout_s``, instead of a
    silent hang or "Connection closed by peer" on the others. Skipped once this
    rank failed (its peers are stopping) or a hang was reported."""
    if current.layout.world_size == 1 or not dist.is_initialized():
        return
    if _abort.FAILED.is_set() or _watchdog.HANG_REPORTED.is_set():
        return
    try:
        with Waiting(("collective", "barrier (in mpar.shutdown)", None)):
            dist.barrier()
    except Exception as exc:  # a peer is gone: its launcher reports it; tear down anyway
        with contextlib.suppress(Exception):
            sys.stderr.write(f"mpar: shutdown's final barrier failed ({exc}); tearing down\n")


def _mark_failed(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """``sys.excepthook`` while mpar runs: an uncaught exception is a failure."""
    _abort.FAILED.set()
    _ORIGINAL_EXCEPTHOOK(kind, value, tb)


_ORIGINAL_EXCEPTHOOK = sys.excepthook


def shutdown() -> None:
    """Tear down what ``init`` created; ``init`` may then be called again.

    Every piece of process state of :mod:`mpar.comm._process_state` is reset: first,
    while the process groups are usable, a pending checkpoint finishes and the caches
    of the run are cleared; then, after a final barrier, this session, the watcher
    and watchdog threads, the flight recorder, the tensor-parallel groups and the exit
    hooks; last the default process group, when ``init`` created it. What stays is
    listed there too (the rendezvous store, marks on the user's modules).
    """
    if _SESSION is None:
        return
    _process_state.reset_pieces(teardown=False)
    _final_barrier(_SESSION.state)
    owns = _SESSION.owns_process_group
    _process_state.reset_pieces(teardown=True)
    if owns and dist.is_initialized():
        dist.destroy_process_group()


def _end_session() -> None:
    global _SESSION
    current, _SESSION = _SESSION, None
    if current is not None:
        current.state.p2p_links.close()


def _unhook_exit() -> None:
    """``shutdown`` ran: no need to run it at exit; uncaught exceptions are the user's."""
    global _EXIT_HOOKED
    if _EXIT_HOOKED:
        atexit.unregister(_shutdown_at_exit)
        _EXIT_HOOKED = False
    if sys.excepthook is _mark_failed:
        sys.excepthook = _ORIGINAL_EXCEPTHOOK


def _exit_unhooked() -> bool:
    return not _EXIT_HOOKED and sys.excepthook is not _mark_failed


def _fresh_progress() -> None:
    PROGRESS.reset(RECENT)


_process_state.register(
    "mpar.comm._lifecycle._SESSION", _end_session, lambda: _SESSION is None, teardown=True
)
_process_state.register("mpar.comm._abort", _abort.stop_watcher, _abort.is_stopped, teardown=True)
_process_state.register("mpar.comm._watchdog", _watchdog.stop, _watchdog.is_stopped, teardown=True)
_process_state.register(
    "mpar.comm._progress.PROGRESS", _fresh_progress, PROGRESS.is_fresh, teardown=True
)
_process_state.register(
    "mpar.comm._tp_ops._GROUPS", clear_tp_groups, tp_groups_cleared, teardown=True
)
_process_state.register(
    "mpar.comm._ep_ops._GROUPS", clear_ep_groups, ep_groups_cleared, teardown=True
)
_process_state.register("mpar.comm._ep_ops.TRAFFIC", TRAFFIC.reset, TRAFFIC.is_fresh, teardown=True)
_process_state.register(
    "mpar.comm._cp_ops._GROUPS", clear_cp_groups, cp_groups_cleared, teardown=True
)
_process_state.register(
    "mpar.comm._lifecycle._EXIT_HOOKED", _unhook_exit, _exit_unhooked, teardown=True
)
