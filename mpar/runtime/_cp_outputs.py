"""The step outputs of a CP group, put together as one process would have returned them.

Under context parallelism each rank of a CP group runs the step function on its tokens.
When the last stage's ranks have every microbatch's result, they exchange them over the
CP group (one ``all_gather_object``, at the same point of every CP rank's schedule) and
combine them (``mpar.context_parallel.combine``); CP rank 0 then sends the replica's
outputs on as without CP.
"""

from __future__ import annotations

from mpar._cp_context import CPContext
from mpar.comm import ProcessGrid
from mpar.comm._collectives import all_gather_object_cp
from mpar.context_parallel import combine

__all__ = ["combine_over_cp"]


def combine_over_cp(
    results: list[object], contexts: list[CPContext], grid: ProcessGrid
) -> list[object]:
    """Each microbatch's result combined over this rank's CP group (the same list on every
    rank of the group)."""
    mine = [(r, c.loss_weight) for r, c in zip(results, contexts)]
    every = all_gather_object_cp(mine, grid)
    return [combine([rank[j] for rank in every], contexts[j]) for j in range(len(results))]
