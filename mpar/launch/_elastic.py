"""Run a job with torch's elastic agent (what ``torchrun`` uses).

Process management, signal forwarding, restarts and error files are torch's
(``torch.distributed.launcher.api.elastic_launch``). mpar adds one rendezvous
backend, ``mpar-static``: torchrun's static rendezvous, except that node 0's
TCP store serves on a socket the launcher bound itself (loopback unless
``--master-addr`` is given; a free port unless ``--master-port`` is given).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mpar._compat import launch_config
from mpar.launch._checks import open_rendezvous_socket
from mpar.launch._child import BOOTSTRAP_PATH
from mpar.launch._options import LaunchOptions
from mpar.launch._report import (
    RankFailure,
    choose_root,
    exit_status,
    failure_from_record,
    format_report,
)

__all__ = ["run_elastic"]

BACKEND = "mpar-static"
_SHUTDOWN_TIMEOUT_S = 5  # SIGTERM -> SIGKILL grace for the surviving ranks


class _FixedEndpointRendezvous(RendezvousHandler):
    """One rendezvous of a fixed number of nodes at a known address (no elasticity)."""

    def __init__(
        self,
        *,
        addr: str,
        port: int,
        node_rank: int,
        nnodes: int,
        run_id: str,
        timeout_s: float,
        listen_fd: int,
    ) -> None:
        self._addr, self._port = addr, port
        self._node_rank, self._nnodes = node_rank, nnodes
        self._run_id, self._timeout_s, self._listen_fd = run_id, timeout_s, listen_fd
        self._store: Store | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers' env:// init connects to this store instead of serving one

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            is_server = self._node_rank == 0
            self._store = TCPStore(
                self._addr,
                self._port,
                self._nnodes,
                is_server,
                datetime.timedelta(seconds=self._timeout_s),
                master_listen_fd=self._listen_fd if is_server else None,
            )
        return RendezvousInfo(
            PrefixStore(self._run_id, self._store),
            self._node_rank,
            self._nnodes,
            RendezvousStoreInfo(self._addr, self._port),
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, _, port = params.endpoint.rpartition(":")
    return _FixedEndpointRendezvous(
        addr=host.strip("[]"),
        port=int(port),
        node_rank=int(params.config["rank"]),
        nnodes=params.max_nodes,
        run_id=params.run_id,
        timeout_s=float(params.config.get("timeout", 300)),
        listen_fd=int(params.config.get("listen_fd", -1)),
    )


rendezvous_handler_registry.register(BACKEND, _create_handler)


@contextlib.contextmanager
def _environ_overrides(extra: Mapping[str, str]) -> Iterator[None]:
    """The agent hands ``os.environ`` to the workers; set ``extra`` there for the run."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _endpoint(options: LaunchOptions, port: int) -> str:
    addr = options.master_addr or "127.0.0.1"
    addr = addr.strip("[]")
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _launch_config(options: LaunchOptions, port: int, listen_fd: int, log_dir: str) -> LaunchConfig:
    shutdown = None if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ else _SHUTDOWN_TIMEOUT_S
    extra: dict[str, Any] = {} if shutdown is None else {"shutdown_timeout": shutdown}
    return launch_config(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=options.run_id,
        role="mpar",
        rdzv_endpoint=_endpoint(options, port),
        rdzv_backend=BACKEND,
        rdzv_configs={"rank": options.node_rank, "listen_fd": listen_fd},
        rdzv_timeout=options.rdzv_timeout,
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        **extra,
    )


def _failure(global_rank: int, failure: ProcessFailure) -> RankFailure:
    record: dict[str, Any] = failure.message if isinstance(failure.message, dict) else {}
    host = socket.gethostname()
    if record:
        found = failure_from_record(
            record, rank=global_rank, pid=failure.pid, exitcode=failure.exitcode
        )
        return RankFailure(**{**found.__dict__, "host": found.host or host})
    return RankFailure(rank=global_rank, pid=failure.pid, host=host, exitcode=failure.exitcode)


def run_elastic(options: LaunchOptions, extra_env: Mapping[str, str]) -> int:
    """Start ``options.nproc_per_node`` workers on this node; the exit status of the job."""
    port, listen_fd = options.master_port or 29500, -1
    if options.node_rank == 0:
        listener = open_rendezvous_socket(options)
        port = int(listener.getsockname()[1])
        listen_fd = listener.detach()  # the TCP store owns (and closes) it from here on
    log_dir = tempfile.mkdtemp(prefix="mpar-launch-")
    config = _launch_config(options, port, listen_fd, log_dir)
    args = ["-u", BOOTSTRAP_PATH, options.script, *options.script_args]
    try:
        with _environ_overrides(extra_env):
            elastic_launch(config, entrypoint=sys.executable)(*args)
        return 0
    except ChildFailedError as exc:
        failures = [_failure(rank, f) for rank, f in sorted(exc.failures.items())]
        sys.stderr.write(format_report(failures, launcher="mpar launch"))
        return exit_status(choose_root(failures))
    except SignalException as exc:
        sys.stderr.write(f"mpar launch: stopped the job on {exc.sigval.name}\n")
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
