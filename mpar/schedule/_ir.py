"""The schedule IR: actions and per-rank action lists.

Index letters used throughout ``mpar.schedule``: ``p`` pipeline degree (number
of ranks), ``v`` virtual stages (chunks) per rank, ``m`` microbatches,
``r`` a rank, ``s`` a stage, ``c`` a chunk (``s = c * p + r``), ``j`` a
microbatch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NotRequired, TypedDict

from mpar.errors import ScheduleError
from mpar.schedule._text_grid import format_grid

__all__ = [
    "COMMUNICATION_KINDS",
    "COMPUTE_KINDS",
    "PLACEMENTS",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleDict",
    "stage_rank",
]


class ScheduleDict(TypedDict):
    """A schedule as JSON (``Schedule.to_dict``): actions in their text form per rank."""

    num_stages: int
    num_ranks: int
    num_microbatches: int
    actions: dict[str, list[str]]
    name: NotRequired[str]
    placement: NotRequired[str]


PLACEMENTS = ("looped", "v")
"""How stages map to ranks: ``looped`` puts stage ``s`` on rank ``s % p`` (rank ``r``
holds ``r, r+p, r+2p, ...``); ``v`` (two chunks per rank, ZBV) puts stage ``s < p``
on rank ``s`` and stage ``s >= p`` on rank ``2p-1-s``, so the last stage shares the
first stage's rank and the model's path runs down the ranks and back up."""


def stage_rank(stage: int, num_stages: int, num_ranks: int, placement: str = "looped") -> int:
    """The rank that holds ``stage`` under ``placement`` (see ``PLACEMENTS``)."""
    if placement == "v":
        return stage if stage < num_ranks else num_stages - 1 - stage
    return stage % num_ranks


class Kind(str, Enum):
    """What an action does. The value is its text form in ``1F3``."""

    F = "F"
    """Forward of one microbatch through one stage."""
    B = "B"
    """Full backward (input and weight gradients) of one microbatch."""
    I = "I"  # noqa: E741 - the name torch.distributed.pipelining uses
    """Backward for the input gradient only (zero-bubble schedules)."""
    W = "W"
    """Backward for the weight gradient only (zero-bubble schedules)."""
    SEND_F = "SEND_F"
    """Send this stage's forward output to the next stage's rank."""
    RECV_F = "RECV_F"
    """Receive this stage's forward input from the previous stage's rank."""
    SEND_B = "SEND_B"
    """Send this stage's input gradient to the previous stage's rank."""
    RECV_B = "RECV_B"
    """Receive this stage's output gradient from the next stage's rank."""
    UNSHARD = "UNSHARD"
    """Gather this stage's sharded parameters (ZeRO-3); no microbatch."""
    RESHARD = "RESHARD"
    """Free this stage's gathered parameters again; no microbatch."""
    REDUCE_GRAD = "REDUCE_GRAD"
    """Reduce(-scatter) this stage's gradients over data parallel; no microbatch."""


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMMUNICATION_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
_STAGE_WIDE_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})
_ACTION_RE = re.compile(r"(\d+)([A-Z_]+)(\d*)")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` applied to ``stage`` for ``microbatch``.

    ``microbatch`` is None exactly for UNSHARD, RESHARD and REDUCE_GRAD, which
    act on a whole stage. The text form is ``{stage}{KIND}{microbatch}``:
    ``1F3``, ``0B7``, ``2SEND_F5``, ``0UNSHARD``.
    """

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"action kind must be a Kind, got {self.kind!r}")
        if self.stage < 0:
            raise ScheduleError(f"action stage must be >= 0, got {self.stage}")
        if self.kind in _STAGE_WIDE_KINDS:
            if self.microbatch is not None:
                raise ScheduleError(f"{self.kind.value} takes no microbatch, got {self.microbatch}")
        elif self.microbatch is None or self.microbatch < 0:
            raise ScheduleError(
                f"{self.kind.value} needs a microbatch >= 0, got {self.microbatch!r}"
            )

    def __str__(self) -> str:
        suffix = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the text form (``"1F3"``, ``"0UNSHARD"``); inverse of ``str``."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '{{stage}}{{KIND}}{{microbatch}}' "
                "such as '1F3', '0B7', '2SEND_F5' or '0UNSHARD'"
            )
        stage, name, microbatch = match.groups()
        try:
            kind = Kind(name)
        except ValueError:
            known = ", ".join(k.value for k in Kind)
            raise ScheduleError(
                f"cannot parse action {text!r}: unknown kind {name!r} (known: {known})"
            ) from None
        try:
            return cls(int(stage), kind, int(microbatch) if microbatch else None)
        except ScheduleError as error:
            raise ScheduleError(f"cannot parse action {text!r}: {error}") from None


@dataclass
class Schedule:
    """For every rank, the ordered list of actions it executes.

    With the default ``looped`` placement stage ``s`` lives on rank
    ``s % num_ranks``, so rank ``r`` holds stages ``r, r + p, r + 2p, ...``;
    ``placement="v"`` is ZBV's V shape (see ``PLACEMENTS``). ``str(schedule)``
    is a rank x step grid.
    """

    num_stages: int
    num_ranks: int
    num_microbatches: int
    actions: dict[int, list[Action]]
    name: str = field(default="", compare=False)
    """A label for renderers, such as ``"interleaved"``."""
    placement: str = "looped"
    """``"looped"`` or ``"v"`` (``PLACEMENTS``)."""

    def __post_init__(self) -> None:
        for key in ("num_stages", "num_ranks", "num_microbatches"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{key} must be a positive integer, got {value!r}")
        if self.num_stages % self.num_ranks:
            raise ScheduleError(
                f"num_stages ({self.num_stages}) must be a multiple of num_ranks "
                f"({self.num_ranks}): every rank holds the same number of stages"
            )
        if self.placement not in PLACEMENTS:
            raise ScheduleError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "v" and self.num_stages != 2 * self.num_ranks:
            raise ScheduleError(
                f"the V placement has two stages per rank: {2 * self.num_ranks} stages on "
                f"{self.num_ranks} ranks, got {self.num_stages}"
            )

    @property
    def virtual_stages(self) -> int:
        """Stages (chunks) per rank, ``v = num_stages // num_ranks``."""
        return self.num_stages // self.num_ranks

    def stage_to_rank(self, stage: int) -> int:
        """The rank that holds ``stage`` (looped placement: ``stage % num_ranks``)."""
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        return stage_rank(stage, self.num_stages, self.num_ranks, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by ``rank``, in chunk order."""
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"rank {rank} out of range 0..{self.num_ranks - 1}")
        return [s for s in range(self.num_stages) if self.stage_to_rank(s) == rank]

    @property
    def is_forward_only(self) -> bool:
        """True when no rank has a backward (B, I or W) action."""
        backward = {Kind.B, Kind.I, Kind.W}
        return not any(a.kind in backward for a in self.iter_actions())

    def iter_actions(self) -> Iterator[Action]:
        """Every action of every rank, rank by rank."""
        for rank in sorted(self.actions):
            yield from self.actions[rank]

    def __str__(self) -> str:
        return self.format_grid()

    def format_grid(
        self, *, mark: tuple[int, int] | None = None, mark_rank: int | None = None, note: str = ""
    ) -> str:
        """The rank x step grid; ``mark=(rank, step)`` brackets one cell."""
        ranks = sorted(set(range(self.num_ranks)) | set(self.actions))
        rows = [[str(a) for a in self.actions.get(rank, [])] for rank in ranks]
        position = {rank: index for index, rank in enumerate(ranks)}
        cell = None if mark is None else (position.get(mark[0], -1), mark[1])
        return format_grid(
            [f"rank {rank}" for rank in ranks],
            rows,
            corner="step",
            mark=cell,
            mark_row=None if mark_rank is None else position.get(mark_rank),
            note=note,
        )

    def to_dict(self) -> ScheduleDict:
        """A JSON-ready dict; actions in their text form."""
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "placement": self.placement,
            "actions": {str(r): [str(a) for a in acts] for r, acts in self.actions.items()},
        }

    @classmethod
    def from_dict(cls, data: ScheduleDict) -> Schedule:
        """Inverse of ``to_dict``."""
        actions = {int(r): _parse_all(texts) for r, texts in data["actions"].items()}
        return cls(
            int(data["num_stages"]),
            int(data["num_ranks"]),
            int(data["num_microbatches"]),
            actions,
            name=str(data.get("name", "")),
            placement=str(data.get("placement", "looped")),
        )


def _parse_all(texts: Sequence[str]) -> list[Action]:
    return [Action.parse(text) for text in texts]
