"""Checkpoints: ``mpar.save_checkpoint`` / ``mpar.load_checkpoint``.

A checkpoint is a torch.distributed.checkpoint (DCP) directory: every rank
writes only what it owns — the parameters of its pipeline stages, its ZeRO
slice of them (the fp32 master values, from the CPU when offloaded) and of the
optimizer state — and no rank gathers the model. Parameters keep the original
module's state-dict keys and optimizer state is keyed by parameter name, so a
checkpoint reloads into any layout (pipeline degree, virtual stages, data
parallelism, ZeRO stage, offload, mixed precision), into a model that is not
partitioned yet, and into plain PyTorch with ``torch.distributed.checkpoint``
(see ``docs/runtime.md``)::

    handle = mpar.save_checkpoint("ckpt", model, optimizer, user_content={"step": step})
    user = mpar.load_checkpoint("ckpt", model, optimizer)    # ckpt/latest

Each save writes a new ``ckpt/ckpt-NNNNNN`` directory through a temporary one
and commits it atomically (see :mod:`mpar.checkpoint._dirs`): an interrupted
save — a rank killed mid-write included — leaves ``latest`` on the previous
checkpoint, and an incomplete directory is never loaded. ``async_save=True``
returns once this rank's shards are copied to host memory; the files are
written and committed in a background thread while training continues
(``handle.wait()`` or :func:`wait_checkpoint` to block; the next save or load
and ``mpar.shutdown`` wait for it). Loading cannot run code: DCP's metadata is
unpickled with an allow-list and every other value with ``weights_only=True``,
so ``user_content`` must be made of tensors, numbers, strings, lists, tuples
and dicts. Single-file checkpoints of the earlier format still load.

Nothing is lost silently: a second job saving into a root while a save runs
there is refused (the root's lock names the owner); the commit checks that
every file the metadata names is there; a load checks every file first and
raises :class:`CheckpointError` naming a missing, truncated or unreadable one;
and a load is strict (missing, unexpected or reshaped model entries raise)
unless ``strict=False``, which returns a :class:`PartialLoad`.
"""

from mpar.checkpoint._async import CheckpointHandle, wait_checkpoint
from mpar.checkpoint._common import FORMAT, CheckpointError
from mpar.checkpoint._load import PartialLoad, load_checkpoint
from mpar.checkpoint._save import save_checkpoint

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointHandle",
    "PartialLoad",
    "load_checkpoint",
    "save_checkpoint",
    "wait_checkpoint",
]
