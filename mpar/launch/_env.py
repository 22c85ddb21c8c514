"""The environment every launched process gets on top of the launcher's own (pure)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from mpar.launch._options import LaunchOptions

__all__ = ["TORCHRUN_VARIABLES", "intra_op_threads", "worker_environment"]

# Set per process by torch's elastic agent; they must not leak into an --mpi job,
# where mpar.init() would otherwise take them for a torchrun layout.
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
)


def intra_op_threads(cpus: int, local_processes: int) -> int:
    """CPUs shared evenly between the processes of one node, at least one each."""
    return max(1, cpus // max(1, local_processes))


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def worker_environment(
    options: LaunchOptions, environ: Mapping[str, str], *, cpus: int
) -> dict[str, str]:
    """Variables to add for the workers (the user's own settings always win).

    * ``OMP_NUM_THREADS``: CPUs per local process (torchrun would force 1);
    * ``MPAR_CONFIG``: the absolute path given with ``--config``;
    * ``GLOO_SOCKET_IFNAME``: the loopback interface for a single-node job
      without ``--master-addr``, so that gloo, too, listens on loopback only.
    """
    extra: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in environ:
        extra["OMP_NUM_THREADS"] = str(intra_op_threads(cpus, options.nproc_per_node))
    if options.config is not None:
        extra["MPAR_CONFIG"] = options.config
    single_node = options.nnodes == 1 and options.master_addr is None
    if single_node and "GLOO_SOCKET_IFNAME" not in environ:
        interface = _loopback_interface()
        if interface is not None:
            extra["GLOO_SOCKET_IFNAME"] = interface
    return extra
