"""Checks made before any process starts: the pipeline degree and the rendezvous port.

The config is read here directly (JSON or YAML, only the pipeline degree) so that
a job that cannot work fails in the launcher with one clear message instead of
N tracebacks from N processes.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
from collections.abc import Mapping
from typing import Any

from mpar.launch._options import LaunchError, LaunchOptions

__all__ = ["check_pipeline_degree", "is_loopback", "open_rendezvous_socket", "read_config"]

_PIPELINE_KEYS = ("pipeline_parallel_degree", "partitions")


def read_config(source: str, *, is_path: bool) -> Mapping[str, Any]:
    """The config dict from a JSON/YAML file, or from inline JSON text."""
    try:
        if not is_path:
            data: Any = json.loads(source)
        else:
            with open(source, encoding="utf-8") as fp:
                text = fp.read()
            if source.endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
    except (OSError, ValueError) as exc:  # yaml.YAMLError is not a ValueError
        raise LaunchError(f"cannot read the mpar config {source!r}: {exc}") from exc
    except Exception as exc:
        raise LaunchError(f"cannot parse the mpar config {source!r}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise LaunchError(
            f"the mpar config {source!r} must hold a mapping of keys to values, "
            f"got {type(data).__name__}."
        )
    return data


def _config_source(options: LaunchOptions, environ: Mapping[str, str]) -> tuple[str, bool] | None:
    if options.config is not None:
        return options.config, True
    value = environ.get("MPAR_CONFIG", "").strip()
    if not value:
        return None
    return value, not value.startswith("{")


def check_pipeline_degree(options: LaunchOptions, environ: Mapping[str, str]) -> None:
    """Refuse a job whose process count cannot hold the config's pipeline degree."""
    source = _config_source(options, environ)
    if source is None:
        return
    config = read_config(source[0], is_path=source[1])
    found = [(key, config[key]) for key in _PIPELINE_KEYS if key in config]
    if not found:
        return
    key, degree = found[0]
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        return  # mpar.init() reports badly typed values with the full config check
    world = options.world_size
    layout = f"--nproc-per-node {options.nproc_per_node} x --nnodes {options.nnodes}"
    where = "--config" if options.config is not None else "MPAR_CONFIG"
    if world < degree:
        raise LaunchError(
            f"{where} asks for {key}={degree} but the job has only {world} processes "
            f"({layout}). Start at least {degree} processes, e.g. --nproc-per-node "
            f"{-(-degree // options.nnodes)}, or lower {key}."
        )
    if world % degree:
        raise LaunchError(
            f"{where} asks for {key}={degree} but {world} processes ({layout}) do not divide "
            f"into pipelines of {degree}: use a multiple of {degree} processes."
        )


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def _bind_listener(host: str | None, port: int) -> socket.socket:
    if host is not None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=128)
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128
        )
    return socket.create_server(("", port), backlog=128)


def free_port(host: str | None = "127.0.0.1") -> int:
    with _bind_listener(host, 0) as sock:
        return int(sock.getsockname()[1])


def open_rendezvous_socket(options: LaunchOptions) -> socket.socket:
    """Bind node 0's rendezvous listener (the launcher keeps it; torch's store serves on it).

    Loopback only unless ``--master-addr`` names another address; then every
    interface, as node 0's address seen by others (a DNS name, a Kubernetes
    service) need not be an address of this machine. Without ``--master-port``
    the kernel picks a free port, so there is no race with other jobs.
    """
    addr = options.master_addr
    if addr is None or is_loopback(addr):
        host: str | None = "::1" if addr in ("::1", "[::1]") else "127.0.0.1"
    else:
        host = None
    port = options.master_port or 0
    try:
        return _bind_listener(host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise LaunchError(
                f"cannot listen on {host or '*'}:{port} for the rendezvous: {exc}"
            ) from exc
        try:
            other = f"e.g. --master-port {free_port(host)}"
        except OSError:
            other = "another port"
        hint = "" if options.nnodes > 1 else " (or leave out --master-port to get a free one)"
        raise LaunchError(
            f"--master-port {port} is busy on {host or 'this machine'}: another process "
            f"(perhaps a previous job) is listening there. Choose {other}{hint}."
        ) from exc
