"""The one seam for device kinds (cpu, cuda, xla): every device-type branch lives here.

The rest of mpar asks this module instead of testing ``device.type``:

* **placement**: :func:`pick_device` turns the ``device`` config value into this
  rank's ``torch.device`` (and makes it current on CUDA);
  :func:`to_device` moves (nested) tensors there.
* **backend**: :func:`default_backend` resolves ``backend: auto``,
  :func:`check_backend` refuses one that would compute wrong sums,
  :func:`group_backends` gives the world's and the data-parallel groups';
  :func:`wire_device` says where a collective's buffers must live for a backend
  (an XLA tensor on gloo is *host-staged*: copied to the CPU, communicated,
  copied back); :func:`p2p_device` does the same for pipeline transfers.
* **host memory**: :func:`host_buffer` (pinned when the device is CUDA, so
  copies can overlap compute), :func:`copy_` (non-blocking only where that is
  safe and useful), :func:`wait_copies` before the host reads what a
  non-blocking copy wrote, :func:`activation_offload` for ``offload_activations``.
* **modules and recomputation**: :func:`move_module` (parameters stay the same
  objects, so an optimizer built earlier keeps working), :func:`prepare_recompute`
  (activation checkpointing's RNG handling on XLA).
* **synchronisation and step hooks**: :func:`synchronize` (timing),
  :func:`after_action` and :func:`after_optimizer_step` (XLA graph cuts, see below).
* **streams and events**: :mod:`mpar._streams` (ZeRO's gathers, copies and
  reductions on side streams on CUDA; one stream elsewhere).
* **memory**: :func:`memory_stats`; :func:`storage_key` and :func:`same_memory`
  (storage identity without data pointers, which XLA tensors lack).

XLA graph cuts. torch_xla records operations lazily and compiles the pending
graph when it is cut (``torch_xla.sync()``). mpar cuts after every forward or
backward action of the schedule and after the optimizer step: each action's
outputs are materialised anyway (they are sent to another rank), every
microbatch then produces the same graph (compiled once, reused for every
microbatch and step), and no graph grows across microbatches or steps. On cpu
and cuda both hooks do nothing.

torch_xla is imported lazily, inside the functions that need it, so mpar runs
(and type-checks) without it.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TypeVar

import torch

from mpar._tree import tree_map
from mpar.errors import ConfigError

__all__ = [
    "has_cpu_flash_attention",
    "activation_offload",
    "can_free_storage",
    "after_action",
    "after_optimizer_step",
    "copy_",
    "copy_to_host",
    "counted_wait",
    "check_backend",
    "check_ranks_per_device",
    "default_backend",
    "SYNCS",
    "SYNC_DEBUG_ENV",
    "SyncLedger",
    "sync_debug",
    "free_storage",
    "group_backends",
    "host_buffer",
    "host_value",
    "memory_stats",
    "mesh_device_type",
    "move_module",
    "p2p_device",
    "pick_device",
    "restore_storage",
    "prepare_recompute",
    "same_memory",
    "set_threads",
    "storage_key",
    "synchronize",
    "takes_objects",
    "to_device",
    "wait_copies",
    "wait_event",
    "wire_device",
    "xla_runtime",
]

T = TypeVar("T")

_CPU = torch.device("cpu")
_BACKEND_DEVICES = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "xla": "xla"}
"""The device type each backend communicates tensors of (anything else is host-staged)."""
_XLA_COLLECTIVES = ("TPU", "NEURON")
"""PJRT devices whose XLA process group reduces across processes (not PJRT's CPU)."""


# ---------------------------------------------------------------- host reads


class SyncLedger:
    """Counts, by reason, every place mpar makes the host wait for the device: a value
    read (``.item()``, ``bool(t)``), a wait for copies, a device synchronize. Each goes
    through :func:`host_value`, :func:`wait_copies` or :func:`synchronize`; on the CPU
    nothing waits, and the calls are counted all the same, so a test on the CPU pins
    what a GPU step would wait for."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def count(self, reason: str) -> None:
        self.counts[reason] += 1

    def take(self) -> dict[str, int]:
        """The counts since the last :meth:`take` (by reason), and start again."""
        out, self.counts = dict(self.counts), collections.Counter()
        return out


SYNCS = SyncLedger()
"""This process's ledger (see :class:`SyncLedger`)."""


def host_value(tensor: torch.Tensor, reason: str) -> float | int | bool:
    """``tensor.item()``, counted in :data:`SYNCS` under ``reason``."""
    with counted_wait(reason):
        return tensor.item()


@contextlib.contextmanager
def counted_wait(reason: str) -> Iterator[None]:
    """A host wait for the device inside: counted in :data:`SYNCS` under ``reason``
    (and so exempt from :func:`sync_debug`)."""
    SYNCS.count(reason)
    with _counted():
        yield


SYNC_DEBUG_ENV = "MPAR_SYNC_DEBUG"
"""``warn`` or ``error``: inside a step's schedule and the optimizer's step and clipping
on CUDA, ``torch.cuda.set_sync_debug_mode`` that mode, with the ledger's own waits
exempt: a host synchronisation the ledger does not count warns (or raises), so the
ledger's count is every wait there is (the GPU check runs with it)."""

_debugging = False
"""Whether :func:`sync_debug` is active (the ledger's waits then exempt themselves)."""


@contextlib.contextmanager
def sync_debug() -> Iterator[None]:
    """The steady-state part of a step: with :data:`SYNC_DEBUG_ENV` set and CUDA in use,
    torch's sync debug mode is on inside (restored after); nothing otherwise."""
    global _debugging
    mode = os.environ.get(SYNC_DEBUG_ENV, "")
    if mode not in ("", "warn", "error"):
        raise ConfigError(
            f"environment variable {SYNC_DEBUG_ENV} is {mode!r}; use 'warn' or 'error' "
            "(report or refuse host synchronisations the sync ledger does not count), "
            "or leave it unset"
        )
    if not mode or _debugging or not torch.cuda.is_initialized():
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    _debugging = True
    try:
        yield
    finally:
        _debugging = False
        torch.cuda.set_sync_debug_mode(before)


@contextlib.contextmanager
def _counted() -> Iterator[None]:
    """A wait the ledger counts: exempt from :func:`sync_debug`."""
    if not _debugging:
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


# ---------------------------------------------------------------- placement


def _xla() -> ModuleType:
    """``torch_xla``, or a ConfigError that says how to get it."""
    try:
        import torch_xla
    except ImportError:
        raise ConfigError(
            "config key 'device' is 'xla' but torch_xla is not installed: "
            "pip install torch_xla (matching your torch version) and set PJRT_DEVICE "
            "(CPU, TPU, NEURON, CUDA), or choose device 'cpu' or 'cuda'"
        ) from None
    return torch_xla


def xla_runtime() -> str:
    """PJRT's device type for XLA (``"CPU"``, ``"TPU"``, ``"NEURON"``, ``"CUDA"``, ...)."""
    _xla()
    import torch_xla.runtime as xr

    return str(xr.device_type() or "CPU").upper()


def resolve_kind(kind: str) -> str:
    """The device kind that the config value ``kind`` means here: ``auto`` is CUDA where
    available, else CPU; other values as given."""
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def pick_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device for the config value ``kind`` (``auto``/``cpu``/``cuda``/``xla``)."""
    kind = resolve_kind(kind)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "config key 'device' is 'cuda' but CUDA is not available here "
                "(no GPU visible, or a CPU-only torch build); use device 'cpu' or 'auto'"
            )
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if kind == "xla":
        return torch.device(_xla().device())
    if kind == "cpu":
        return _CPU
    raise ConfigError(f"config key 'device' is {kind!r}; use 'auto', 'cpu', 'cuda' or 'xla'")


def set_threads(local_size: int) -> None:
    """Give each of the host's ``local_size`` ranks its share of the cores for torch's
    CPU threads, unless the user chose (``OMP_NUM_THREADS``)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, host_cores() // max(1, local_size)))


def host_cores() -> int:
    """CPUs this process may run on (respects affinity masks and cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def to_device(value: T, device: torch.device) -> T:
    """``value`` (tensors nested in tuples, lists, dicts) with every tensor on ``device``.

    Host-to-CUDA copies are non-blocking (they are ordered on the current stream
    before any kernel that reads them); tensors already there are returned as is.
    """
    non_blocking = device.type == "cuda"
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), value)


def move_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module.to(device)`` in place, keeping each parameter the same Python object.

    An optimizer built on the parameters before the move keeps updating them.
    ``module.to`` already does so between cpu and cuda (it swaps ``.data``); an
    XLA tensor cannot be the ``.data`` of a CPU parameter, so there the move
    swaps the parameters' contents (``torch.utils.swap_tensors``) instead of
    creating new parameters.
    """
    if device.type != "xla":
        return module.to(device)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


# ---------------------------------------------------------------- backends


def default_backend(device: torch.device, pipeline_degree: int) -> str:
    """``backend: auto``: nccl on cuda; gloo on the CPU; on xla, the XLA process
    group where its collectives work — TPU and Neuron, without pipelining, so that
    every rank runs the same program and the data-parallel group is the world —
    else gloo with host staging (PJRT's CPU device, and any pipeline)."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "xla" and pipeline_degree == 1 and xla_runtime() in _XLA_COLLECTIVES:
        return "xla"
    return "gloo"


def check_backend(device: torch.device, backend: str) -> None:
    """Refuse a backend that would not carry this device's collectives correctly."""
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"config key 'backend' is 'nccl' but the device is {device.type!r} (device 'auto' "
            "finds no GPU here); NCCL needs CUDA: use backend 'gloo' or 'auto' on the CPU"
        )
    if backend == "xla" and xla_runtime() not in _XLA_COLLECTIVES:
        raise ConfigError(
            f"config key 'backend' is 'xla' but PJRT's device is {xla_runtime()}: torch_xla's "
            "process group does not reduce across processes there; use backend 'gloo' or "
            "'auto' (collectives host-staged through gloo)"
        )


def check_ranks_per_device(device: torch.device, backend: str, local_size: int) -> None:
    """Refuse NCCL where this host's ranks outnumber its GPUs: NCCL will not put two
    ranks on one GPU ("Duplicate GPU detected") and would fail at the first collective."""
    if backend != "nccl" or device.type != "cuda":
        return
    gpus = torch.cuda.device_count()
    if local_size > gpus:
        raise ConfigError(
            f"backend 'nccl' with {local_size} ranks on this host but {gpus} visible GPU(s): "
            "NCCL refuses two ranks on one GPU; start at most one rank per GPU, or set "
            "backend 'gloo' (collectives and transfers staged through the host)"
        )


def group_backends(backend: str) -> tuple[str, str]:
    """The backends of (the world and the pipeline groups, the data-parallel groups).

    With ``backend: xla`` only data parallelism uses the XLA process group:
    its point-to-point operations are collective permutes that every rank must
    join in lockstep, not the independent ``isend``/``irecv`` of a pipeline, so
    the world group (pipeline transfers, step outputs, object collectives) is
    gloo, host-staged.
    """
    if backend == "xla":
        _xla()
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")

        return "gloo", "xla"
    return backend, backend


def takes_objects(backend: str) -> bool:
    """Whether a process group of ``backend`` takes torch's object collectives
    (``broadcast_object_list``, ``all_gather_object``): gloo, nccl and mpi do, torch_xla's
    does not."""
    return backend in ("gloo", "nccl", "mpi")


def mesh_device_type(backend: str) -> str | None:
    """The device type of a torch ``DeviceMesh`` whose groups use ``backend`` with
    mpar's timeout: cpu for gloo, cuda for nccl; None for MPI (its groups take no
    options) and XLA (a DeviceMesh makes no XLA groups): mpar makes those itself."""
    return {"gloo": "cpu", "nccl": "cuda"}.get(backend)


def wire_device(device: torch.device, backend: str) -> torch.device:
    """Where a collective over ``backend`` must find a tensor that lives on ``device``:
    ``device`` itself, or the CPU when the backend cannot take it (host staging)."""
    native = _BACKEND_DEVICES.get(backend, "cpu")
    return device if native == device.type else _CPU


def p2p_device(device: torch.device, backend: str) -> torch.device:
    """Where pipeline transfers (``isend``/``irecv``) are built: as :func:`wire_device`,
    except that XLA transfers always go through the host (no XLA point-to-point)."""
    if device.type == "xla":
        return _CPU
    return wire_device(device, backend)


# ---------------------------------------------------------------- host memory


def on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is in host memory (numpy can write it in place)."""
    return is_host(tensor.device)


def has_cpu_flash_attention(tensor: torch.Tensor) -> bool:
    """Whether block attention on ``tensor``'s device runs torch's CPU flash kernel (which
    returns the log-sum-exp); elsewhere it is float32 matmuls (``mpar._attention_blocks``)."""
    return tensor.device.type == "cpu"


def is_host(device: torch.device) -> bool:
    """Whether ``device`` is host memory."""
    return device.type == "cpu"


def host_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised CPU buffer that exchanges data with ``device``: pinned for
    CUDA (asynchronous copies), plain elsewhere (pinning needs CUDA)."""
    pin = device.type == "cuda"
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``, non-blocking between CUDA and pinned host memory.

    After a non-blocking device-to-host copy the host must :func:`wait_copies`
    before it reads ``dst``; host-to-device copies are ordered on the stream.
    """
    cuda = "cuda" in (dst.device.type, src.device.type)
    host = dst if dst.device.type == "cpu" else src
    return dst.copy_(src, non_blocking=cuda and host.is_pinned())


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A detached host copy of ``tensor``, non-blocking from CUDA: :func:`wait_copies`
    before reading it."""
    return tensor.detach().to(_CPU, copy=True, non_blocking=tensor.device.type == "cuda")


def wait_copies(device: torch.device, reason: str = "wait for host copies") -> None:
    """Block until non-blocking copies issued for ``device`` have landed in host memory
    (counted in :data:`SYNCS`)."""
    SYNCS.count(reason)
    if device.type == "cuda":
        with _counted():
            torch.cuda.current_stream(device).synchronize()


def wait_event(event: torch.cuda.Event) -> None:
    """Block the host until ``event`` has completed: a wait its caller has counted in
    :data:`SYNCS` (so exempt from :func:`sync_debug`)."""
    with _counted():
        event.synchronize()


class _XlaRandom:
    """What ``torch.utils.checkpoint`` asks of a device module (``torch.xla``), for XLA:
    save and restore the device's RNG so recomputation draws the same dropout masks
    (torch_xla's own checkpoint is reentrant only)."""

    _initialized = True

    @staticmethod
    def device(index: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: object = None) -> int:
        import torch_xla.core.xla_model as xm

        return int(xm.get_rng_state())

    @staticmethod
    def set_rng_state(state: int, device: object = None) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state))


def prepare_recompute(device: torch.device) -> None:
    """Make ``torch.utils.checkpoint`` (non-reentrant) work on ``device``: on XLA it
    needs a ``torch.xla`` device module, registered here once; nothing elsewhere."""
    if device.type == "xla" and not hasattr(torch, "xla"):
        torch._register_device_module("xla", _XlaRandom)


def activation_offload(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """A context keeping the tensors autograd saves in host memory (pinned on CUDA);
    nothing to do when ``device`` is the CPU."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def can_free_storage(device: torch.device) -> bool:
    """Whether a buffer's storage on ``device`` can be freed and re-grown in place
    (:func:`free_storage`, :func:`restore_storage`). XLA tensors have no storage to
    resize: their gathered buffers are reallocated instead."""
    return device.type != "xla"


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory but keep the tensor and its views (as FSDP does):
    views autograd saved in a forward stay valid objects, and see the data again once
    :func:`restore_storage` has grown the storage and it was refilled. Reading any of
    them in between is undefined: callers refill first."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def restore_storage(tensor: torch.Tensor) -> None:
    """Grow a storage freed by :func:`free_storage` back to ``tensor``'s size
    (contents uninitialised)."""
    nbytes = int((tensor.storage_offset() + tensor.numel()) * tensor.element_size())
    storage = tensor.untyped_storage()
    if storage.size() < nbytes:
        storage.resize_(nbytes)


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, shared by its views. Not a data pointer:
    XLA storages have none (an XLA view's ``data_ptr()`` is its byte offset, and its
    ``storage_offset()`` is 0)."""
    return int(tensor.untyped_storage()._cdata)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same element of the same storage."""
    return storage_key(a) == storage_key(b) and a.data_ptr() == b.data_ptr()


# ---------------------------------------------------------------- sync and hooks


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until the work queued on ``devices`` has run (for timing; counted in
    :data:`SYNCS`)."""
    SYNCS.count("synchronize")
    kinds = {d.type for d in devices}
    if "cuda" in kinds and torch.cuda.is_available():
        with _counted():
            torch.cuda.synchronize()
    if "xla" in kinds:
        _xla().sync(wait=True)


def after_action(device: torch.device) -> None:
    """End of a schedule's forward or backward action: cut the XLA graph here."""
    if device.type == "xla":
        _xla().sync()


def after_optimizer_step(device: torch.device) -> None:
    """End of an optimizer step: cut the XLA graph of the parameter updates."""
    if device.type == "xla":
        _xla().sync()


# ---------------------------------------------------------------- statistics


def reset_peak(device: torch.device) -> None:
    """Start a new peak of ``device``'s allocator (each step, for ``memory_report``);
    a no-op where the device keeps no statistics."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def total_memory(device: torch.device | str) -> int | None:
    """The memory of ``device`` (or of the device a kind such as ``"auto"`` picks) in
    bytes, read from the device (CUDA), else None (the planner's ``device_memory``
    when the config leaves it out)."""
    if isinstance(device, str):
        if device not in ("auto", "cuda") or not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def memory_stats(device: torch.device) -> dict[str, int]:
    """Allocator statistics of ``device`` in bytes: ``allocated``, ``peak`` (since the
    last :func:`reset_peak`) and, on CUDA, ``reserved`` (held by the caching allocator),
    where the device reports them (CUDA; XLA on TPU/GPU), else empty (CPU, PJRT CPU)."""
    if device.type == "cuda":
        return {
            "allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
            "peak": int(torch.cuda.max_memory_allocated(device)),
        }
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(device)
        except (RuntimeError, NotImplementedError):  # PJRT CPU keeps no statistics
            return {}
        return {
            "allocated": int(info.get("bytes_used", 0)),
            "peak": int(info.get("peak_bytes_used", info.get("bytes_used", 0))),
        }
    return {}
