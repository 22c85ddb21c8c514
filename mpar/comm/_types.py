"""Types shared across ``mpar.comm`` and its callers: process groups and transfer labels."""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple, Protocol, TypeAlias

import torch.distributed as dist

__all__ = ["ProcessGroup", "Transfer", "TransferLabel", "Wait", "Work"]

ProcessGroup: TypeAlias = dist.ProcessGroup
"""A ``torch.distributed`` process group (None, where accepted, means every rank)."""


class Transfer(IntEnum):
    """What a pipeline transfer carries (its value is the direction)."""

    ACTIVATIONS = 0
    """A stage's forward input, for ``{stage}F{microbatch}``."""
    GRADIENTS = 1
    """A stage's output gradient, for ``{stage}B{microbatch}`` (or its ``I``)."""


class TransferLabel(NamedTuple):
    """Which transfer a p2p message is: sent in its control block and checked on receipt,
    so two ranks running different schedules fail with both labels in words."""

    kind: Transfer
    stage: int = 0
    """The stage that receives it (activations and gradients)."""
    microbatch: int = 0

    def describe(self) -> str:
        """In words: ``"activations for 1F3"``, ``"gradients for 0B2"``."""
        backward = self.kind == Transfer.GRADIENTS
        data = "gradients" if backward else "activations"
        return f"{data} for {self.stage}{'B' if backward else 'F'}{self.microbatch}"


Wait: TypeAlias = tuple[str, int | str, TransferLabel | ProcessGroup | None]
"""What a rank waits for (``mpar.comm._progress``):

* ``("recv", src, label)``: a pipeline transfer from global rank ``src``;
* ``("send", dst, None)``: sends to ``dst`` still in flight at the end of a step;
* ``("collective", name, group)``: a collective over ``group`` (None: every rank).
"""


class Work(Protocol):
    """An asynchronous collective's handle: ``torch.distributed.Work`` or a wrapper of one."""

    def wait(self) -> object: ...
