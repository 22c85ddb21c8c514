"""Where this process sits in the job: read from torchrun, MPI or SLURM.

:func:`detect_layout` returns a :class:`Layout` (rank, world size, local rank,
local size, rendezvous address and port, and which launcher it came from).
Precedence: torchrun's variables, then MPI (mpi4py), then SLURM's ``srun``
variables, then a single process. Under ``srun --mpi=pmix`` (or ``pmi2``) every task
carries MPI's markers as well: without mpi4py its SLURM variables are read.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from mpar._failure import RUNDIR_ENV
from mpar.errors import CommError

__all__ = ["Layout", "detect_layout", "expand_slurm_nodelist", "free_port"]

_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class Layout:
    """One process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int
    source: str
    """``"torchrun"``, ``"mpi"``, ``"slurm"`` or ``"single"``."""
    error_file: str | None = None
    """torch elastic's error file (``TORCHELASTIC_ERROR_FILE``): where a failure is recorded."""
    run_dir: str | None = None
    """``mpar launch --mpi``'s run folder (``MPAR_LAUNCH_RUNDIR``): failures are recorded there too."""
    restart: int = 0
    """torch elastic's restart count (``TORCHELASTIC_RESTART_COUNT``)."""
    agent_store: bool = False
    """Whether torchrun's agent hosts the job's store (``TORCHELASTIC_USE_AGENT_STORE``)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise CommError(f"environment variable {name}={value!r} is not an integer") from None


def _from_torchrun(env: Mapping[str, str]) -> Layout:
    world = _int_env(env, "WORLD_SIZE")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if world > 1 and missing:
        raise CommError(
            f"RANK and WORLD_SIZE are set (a torchrun-style launch) but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: every rank needs rank 0's address and a free port there to meet at "
            "(torchrun and `mpar launch` set them; by hand: MASTER_ADDR=<rank 0's host> "
            "MASTER_PORT=29500)"
        )
    return Layout(
        rank=_int_env(env, "RANK"),
        world_size=world,
        local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
        local_size=_int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
        source="torchrun",
    )


def _has_mpi4py() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def _from_mpi(env: Mapping[str, str]) -> Layout:
    try:
        from mpi4py import MPI
    except ImportError:
        raise CommError(
            "this process was started by MPI (found "
            f"{[k for k in _MPI_MARKERS if k in env]}) but mpi4py is not installed; "
            "install it with: pip install 'mpar[mpi]'"
        ) from None
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    address = None
    if world.Get_rank() == 0:
        single_host = local_size == world.Get_size()
        host = env.get("MASTER_ADDR") or ("127.0.0.1" if single_host else _host_address())
        port = (
            int(env["MASTER_PORT"])
            if "MASTER_PORT" in env
            else free_port("127.0.0.1" if single_host else "0.0.0.0")
        )
        address = (host, port)
    host, port = world.bcast(address, root=0)
    return Layout(
        rank=world.Get_rank(),
        world_size=world.Get_size(),
        local_rank=local_rank,
        local_size=local_size,
        master_addr=host,
        master_port=port,
        source="mpi",
    )


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list, e.g. ``"gpu[01-03,07],cpu1"``."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            width = len(low)
            for n in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{n:0{width}d}")
    return hosts


def _slurm_tasks_per_node(text: str) -> list[int]:
    """SLURM's compact tasks-per-node list, one count per node: ``"2(x3),1"`` is
    ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise CommError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a list of task counts")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm_node_index(env: Mapping[str, str], nodes: list[str]) -> int:
    """This task's node among the step's nodes (its name in the step's node list; else
    ``SLURM_NODEID``, the node's index in the job, the same where the step spans it)."""
    name = env.get("SLURMD_NODENAME")
    if name in nodes:
        return nodes.index(name)
    return _int_env(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0


def _from_slurm(env: Mapping[str, str]) -> Layout:
    world = _int_env(env, "SLURM_NTASKS")
    nodes = expand_slurm_nodelist(
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    )
    addr = env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
    if "MASTER_PORT" in env:
        port = _int_env(env, "MASTER_PORT")
    else:  # every task derives the same port from the job id
        port = 20000 + zlib.crc32(env.get("SLURM_JOB_ID", "0").encode()) % 20000
    local_size = world
    if "SLURM_STEP_TASKS_PER_NODE" in env:
        per_node = _slurm_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        local_size = per_node[min(_slurm_node_index(env, nodes), len(per_node) - 1)]
    return Layout(
        rank=_int_env(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        local_size=local_size,
        master_addr=addr,
        master_port=port,
        source="slurm",
    )


_VARIABLES = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    "mpi": ("the MPI rank", "the MPI world size", "the node rank", "the node size"),
}
"""Where each launcher's rank, world size, local rank and local size come from."""


def _checked(layout: Layout) -> Layout:
    """``layout``, if its numbers can describe one process of a job (a launcher's
    variables set by hand can disagree: RANK=2 with WORLD_SIZE=2, say)."""
    if layout.source not in _VARIABLES:
        return layout
    rank, world, local_rank, local = _VARIABLES[layout.source]
    problem = None
    if layout.world_size < 1:
        problem = f"{world}={layout.world_size}: a job has at least one process"
    elif not 0 <= layout.rank < layout.world_size:
        problem = (
            f"{rank}={layout.rank} with {world}={layout.world_size}: ranks run from 0 to "
            f"{layout.world_size - 1}"
        )
    elif not 1 <= layout.local_size <= layout.world_size:
        problem = (
            f"{local}={layout.local_size} with {world}={layout.world_size}: a host runs "
            "between 1 and all of the job's processes"
        )
    elif not 0 <= layout.local_rank < layout.local_size:
        problem = (
            f"{local_rank}={layout.local_rank} with {local}={layout.local_size}: local ranks "
            f"run from 0 to {layout.local_size - 1}"
        )
    if problem is None:
        return layout
    raise CommError(
        f"the {layout.source} layout of this process is impossible: {problem}. The launcher's "
        "variables disagree (set by hand, or left over from another launcher?); start the job "
        "with one launcher (`mpar launch`, torchrun, mpirun, srun) or fix the variables"
    )


def detect_layout(env: Mapping[str, str] | None = None) -> Layout:
    """Read this process's layout from the environment of its launcher."""
    env = os.environ if env is None else env
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env
    if "RANK" in env and "WORLD_SIZE" in env:
        layout = _from_torchrun(env)
    elif any(marker in env for marker in _MPI_MARKERS) and (not slurm or _has_mpi4py()):
        layout = _from_mpi(env)
    elif slurm:  # srun's PMIx / PMI-2 plugins set MPI's markers for any program, too
        layout = _from_slurm(env)
    else:
        layout = Layout(0, 1, 0, 1, "127.0.0.1", 0, "single")
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dataclasses.replace(
        _checked(layout),
        error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
        run_dir=env.get(RUNDIR_ENV) or None,
        restart=int(restart) if restart.isdigit() else 0,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
