"""Where this process sits in the job: read from torchrun, MPI or SLURM.

:func:`detect_layout` returns a :class:`Layout` (rank, world size, local rank,
local size, rendezvous address and port, and which launcher it came from).
Precedence: torchrun's variables, then MPI (mpi4py), then SLURM's ``srun``
variables, then a single process.
"""

from __future__ import annotations

import dataclasses
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
    return Layout(
        rank=_int_env(env, "RANK"),
        world_size=world,
        local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
        local_size=_int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
        source="torchrun",
    )


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
        local_size = int(re.split(r"[(,]", env["SLURM_STEP_TASKS_PER_NODE"])[0])
    return Layout(
        rank=_int_env(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        local_size=local_size,
        master_addr=addr,
        master_port=port,
        source="slurm",
    )


def detect_layout(env: Mapping[str, str] | None = None) -> Layout:
    """Read this process's layout from the environment of its launcher."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        layout = _from_torchrun(env)
    elif any(marker in env for marker in _MPI_MARKERS):
        layout = _from_mpi(env)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        layout = _from_slurm(env)
    else:
        layout = Layout(0, 1, 0, 1, "127.0.0.1", 0, "single")
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dataclasses.replace(
        layout,
        error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
        run_dir=env.get(RUNDIR_ENV) or None,
        restart=int(restart) if restart.isdigit() else 0,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
