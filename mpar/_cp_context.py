"""Which tokens each context-parallel rank holds, and what each token may attend to (pure).

A :class:`TokenLayout` cuts a sequence of ``length`` tokens among ``size`` ranks,
head-tail balanced for causal attention: the sequence is cut into ``segments`` equal
segments, each segment into ``2 * size`` chunks, and rank ``r`` holds chunks ``r`` and
``2 * size - 1 - r`` of every segment (in that order)::

    length 16, size 2, segments 1: chunks of 4      rank 0: tokens 0-3, 12-15
                                                    rank 1: tokens 4-7,  8-11

Under a causal mask a query sees the keys before it, so early chunks are cheap and late
ones dear; pairing chunk ``r`` with chunk ``2 size - 1 - r`` gives every rank the same
work. Packed documents (a causal mask per document) can spoil that balance; more
segments restore it (each document's tokens spread over every rank), at the price of
smaller blocks: :func:`balanced_layout` picks the fewest segments whose work is within
10% of the mean on every rank.

A :class:`CPContext` is one microbatch's view: the layout, this rank's place in it,
and where the masks come from — each token's document (from ``position_ids`` resets),
which keys are padding (a 2-D ``attention_mask``), or a given boolean mask. The
attention operators (``mpar.comm._cp_ops``) ask it for the mask of every block of
(query tokens, key tokens) they compute (:meth:`CPContext.block`), and skip blocks
that see nothing. The runtime makes a microbatch's context current
(:func:`using`) around each computation of that microbatch; with none current the
operators compute plain attention on what they are given (one process, profiling).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mpar._attention_blocks import CAUSAL, FULL, BlockMask

__all__ = [
    "BALANCE_TOLERANCE",
    "CPContext",
    "Piece",
    "TokenLayout",
    "balanced_layout",
    "current",
    "natural_pieces",
    "reset_current",
    "unmasked_block",
    "using",
]

BALANCE_TOLERANCE = 0.10
"""Most a rank's causal attention work may exceed the mean (:func:`balanced_layout`)."""

_PIECE = 1024
"""Longest piece of queries or keys one masked block covers in natural order."""


@dataclass(frozen=True)
class TokenLayout:
    """The head-tail split of ``length`` tokens among ``size`` ranks (module docstring)."""

    length: int
    size: int
    segments: int = 1

    def __post_init__(self) -> None:
        if self.length % (2 * self.size * self.segments):
            raise ValueError(
                f"a sequence of {self.length} tokens does not cut into {self.segments} "
                f"segment(s) of 2 x {self.size} equal chunks"
            )

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.size * self.segments)

    @property
    def local_length(self) -> int:
        return self.length // self.size

    def runs(self, rank: int) -> list[tuple[int, int]]:
        """``(global start, length)`` of rank ``rank``'s contiguous runs, in local order."""
        seg, c = self.length // self.segments, self.chunk
        out = []
        for s in range(self.segments):
            for chunk in (rank, 2 * self.size - 1 - rank):
                out.append((s * seg + chunk * c, c))
        return out

    @functools.cached_property
    def _indices(self) -> torch.Tensor:
        rows = [
            torch.cat([torch.arange(a, a + n) for a, n in self.runs(r)]) for r in range(self.size)
        ]
        return torch.stack(rows)

    def index(self, rank: int) -> torch.Tensor:
        """Global index of each of rank ``rank``'s tokens, in local order (long, CPU)."""
        return self._indices[rank]

    @functools.cached_property
    def order(self) -> torch.Tensor:
        """The global index of each token of the ranks' pieces concatenated in rank order."""
        return self._indices.reshape(-1)

    @functools.cached_property
    def inverse(self) -> torch.Tensor:
        """Where each global token sits in the ranks' pieces concatenated in rank order."""
        return torch.argsort(self.order)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of ``x`` along ``dim`` (a copy)."""
        return x.index_select(dim, self.index(rank).to(x.device))

    def unshard(self, pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's piece (in rank order), in natural order."""
        whole = torch.cat(pieces, dim)
        return whole.index_select(dim, self.inverse.to(whole.device))

    def pieces(self, rank: int) -> list[Piece]:
        """Rank ``rank``'s tokens as contiguous runs, at most four blocks (adjacent runs
        joined when there are more); computed once per layout and rank."""
        return _pieces(self, rank)


@functools.lru_cache(maxsize=256)
def _pieces(layout: TokenLayout, rank: int) -> list[Piece]:
    runs = layout.runs(rank)
    per = -(-len(runs) // 4)
    out, offset = [], 0
    for i in range(0, len(runs), per):
        index = torch.cat([torch.arange(a, a + n) for a, n in runs[i : i + per]])
        out.append(Piece(offset, len(index), index))
        offset += len(index)
    return out


@dataclass(frozen=True)
class Piece:
    """Consecutive local tokens ``offset .. offset + length`` and their global indices."""

    offset: int
    length: int
    index: torch.Tensor

    @property
    def local(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    @functools.cached_property
    def contiguous(self) -> bool:
        """Whether the global indices are one run (then masks follow from the bounds)."""
        return int(self.index[-1] - self.index[0]) == self.length - 1

    @property
    def first(self) -> int:
        return int(self.index[0])

    @property
    def last(self) -> int:
        return int(self.index[-1])


def natural_pieces(length: int, masked: bool) -> list[Piece]:
    """The whole sequence in natural order as pieces: one when no elementwise mask is
    needed (the kernel tiles it), else runs of at most :data:`_PIECE` tokens."""
    step = _PIECE if masked else length
    return [
        Piece(a, min(step, length - a), torch.arange(a, min(a + step, length)))
        for a in range(0, length, step)
    ]


def document_ids(positions: torch.Tensor) -> torch.Tensor | None:
    """Each token's document, from ``position_ids`` [B, L] that restart per packed
    document (a new document wherever a position is not its predecessor + 1, as Hugging
    Face reads packed batches); None when every row is one document."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    documents = (step != 1).cumsum(-1)
    return None if bool((documents[:, -1] == 0).all()) else documents


def causal_work(layout: TokenLayout, documents: torch.Tensor | None) -> list[int]:
    """Per rank: the (query, key) pairs a causal mask (per document) lets its tokens
    attend to, summed over the batch."""
    length = layout.length
    where = torch.arange(length)
    if documents is None:
        seen = (where + 1).unsqueeze(0)
    else:
        starts = torch.where(torch.diff(documents, prepend=documents[:, :1] - 1) != 0, where, 0)
        seen = where - torch.cummax(starts, dim=-1).values + 1
    return [int(seen[:, layout.index(r)].sum()) for r in range(layout.size)]


def imbalance(work: list[int]) -> float:
    """How far the busiest rank's work is above the mean (0.1: 10%)."""
    mean = sum(work) / len(work)
    return max(work) / mean - 1 if mean else 0.0


def balanced_layout(length: int, size: int, documents: torch.Tensor | None) -> TokenLayout:
    """The head-tail layout with the fewest segments whose causal work per rank is within
    :data:`BALANCE_TOLERANCE` of the mean (one segment without packed documents)."""
    plain = TokenLayout(length, size)
    if documents is None or size == 1:
        return plain
    chunks = length // (2 * size)
    best = plain, imbalance(causal_work(plain, documents))
    for segments in (m for m in range(1, chunks + 1) if chunks % m == 0):
        layout = TokenLayout(length, size, segments)
        spread = imbalance(causal_work(layout, documents))
        if spread <= BALANCE_TOLERANCE:
            return layout
        if spread < best[1]:
            best = layout, spread
    return best[0]


@dataclass
class CPContext:
    """One microbatch's sequence split, seen from CP rank ``rank`` (module docstring)."""

    layout: TokenLayout
    rank: int
    positions: torch.Tensor
    """Global ``position_ids`` [B or 1, L] of the whole sequence."""
    documents: torch.Tensor | None = None
    """Each token's document [B, L] (packed sequences), or None: one per row."""
    valid: torch.Tensor | None = None
    """Which tokens are real [B, L] (False: padding, never attended to), or None."""
    given: torch.Tensor | None = None
    """A given mask [B or 1, 1, L, L] (True: attend), or None."""
    loss_weight: float = 1.0
    """What this rank's loss is multiplied by before backward; the step's loss is the sum
    of the weighted losses over the CP group (see ``mpar.context_parallel``)."""

    @property
    def masked(self) -> bool:
        """Whether any mask beyond causality applies."""
        return self.documents is not None or self.valid is not None or self.given is not None

    def local_positions(self) -> torch.Tensor:
        """This rank's tokens' ``position_ids`` [B or 1, L / size]."""
        return self.layout.shard(self.positions, self.rank)

    def block(self, q: Piece, k: Piece, causal: bool, window: int) -> BlockMask | None:
        """The mask of queries ``q`` on keys ``k`` (global indices), or None when no query
        sees any key. ``window`` > 0: a query sees only the ``window`` latest keys."""
        if not self.masked and q.contiguous and k.contiguous:
            decided, mask = _bounded(q, k, causal, window)
            if decided:
                return mask
        allowed = _allowed(q.index, k.index, causal, window).view(1, 1, q.length, k.length)
        device = self.positions.device
        allowed = allowed.to(device)
        qi, ki = q.index.to(device), k.index.to(device)
        if self.documents is not None:
            docs = self.documents
            same = docs[:, qi].unsqueeze(-1) == docs[:, ki].unsqueeze(-2)
            allowed = allowed & same.unsqueeze(1)
        if self.valid is not None:
            allowed = allowed & self.valid[:, ki].view(-1, 1, 1, k.length)
        if self.given is not None:
            allowed = allowed & self.given[:, :, qi][:, :, :, ki]
        return _reduced(allowed)


def unmasked_block(q: Piece, k: Piece, causal: bool, window: int) -> BlockMask | None:
    """:meth:`CPContext.block` without a context: causality and the window only."""
    if q.contiguous and k.contiguous:
        decided, mask = _bounded(q, k, causal, window)
        if decided:
            return mask
    return _reduced(_allowed(q.index, k.index, causal, window).view(1, 1, q.length, k.length))


def _reduced(allowed: torch.Tensor) -> BlockMask | None:
    if not bool(allowed.any()):
        return None
    return FULL if bool(allowed.all()) else allowed


def _allowed(qi: torch.Tensor, ki: torch.Tensor, causal: bool, window: int) -> torch.Tensor:
    allowed = torch.ones(len(qi), len(ki), dtype=torch.bool)
    if causal:
        allowed &= ki.unsqueeze(0) <= qi.unsqueeze(1)
    if window > 0:
        allowed &= ki.unsqueeze(0) > qi.unsqueeze(1) - window
    return allowed


def _bounded(q: Piece, k: Piece, causal: bool, window: int) -> tuple[bool, BlockMask | None]:
    """``(True, mask)`` of two runs when their bounds alone decide it, else ``(False, None)``."""
    if window > 0:
        if (causal and k.first > q.last) or k.last <= q.first - window:
            return True, None
        return False, None
    if not causal:
        return True, FULL
    if k.first > q.last:
        return True, None
    if k.last <= q.first:
        return True, FULL
    if k.first == q.first and k.length == q.length:
        return True, CAUSAL
    return False, None


_CURRENT: list[CPContext | None] = [None]


def current() -> CPContext | None:
    """The context of the microbatch being computed, or None."""
    return _CURRENT[0]


def reset_current() -> None:
    """No context current (``mpar.shutdown``: a step that failed inside ``using``)."""
    _CURRENT[0] = None


@contextmanager
def using(context: CPContext | None) -> Iterator[None]:
    """Make ``context`` current for the computations inside (restored after)."""
    previous, _CURRENT[0] = _CURRENT[0], context
    try:
        yield
    finally:
        _CURRENT[0] = previous
