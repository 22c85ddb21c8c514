"""Every piece of mpar's module-level mutable process state, in one list.

What one ``mpar.init`` decided is its :class:`~mpar.comm.Session` (the
:class:`~mpar.comm.State` a step gets, the models and optimizers of the run). What
has to live at module level is registered here by the module that holds it, with
how ``mpar.shutdown`` resets it and how to tell that it is reset. ``shutdown`` resets
every piece (the ones before its final barrier first, then the teardown); after it
each piece is back to its value at import, and ``mpar.init`` may run again
(``tests/multiproc/test_process_state.py`` checks both after a pipeline step).

The pieces, in the order ``shutdown`` resets them:

==================================================  ============================================
before the final barrier
==================================================  ============================================
``mpar.checkpoint._async``                          the pending asynchronous save and its thread:
                                                    the save finishes (a failure is warned
                                                    about), the thread ends
``mpar.runtime._timeline._STEPS``                   the timeline's latest steps (``trace``)
``mpar.runtime._activations._SAVED_BYTES``          bytes autograd saved per stage and input
``mpar.runtime._activations._HELD_FOR_W``           bytes a split backward's I left for its W
``mpar.runtime._split_backward._KEEPING``           the linear layers an I is deferring
``mpar._cp_context._CURRENT``                       the context-parallel context of the
                                                    microbatch being computed
``mpar.context_parallel._attention.FOUND``          attention calls counted while a
                                                    context-parallel model was captured
``mpar.runtime._transfers._PLANS``                  each schedule's receive posts (a cache)
==================================================  ============================================

==================================================  ============================================
teardown (after the final barrier)
==================================================  ============================================
``mpar.comm._lifecycle._SESSION``                   the current ``init`` (its point-to-point
                                                    streams and shared-memory rings closed)
``mpar.comm._abort``                                the failure watcher thread, its store client,
                                                    its events (``FAILED``)
``mpar.comm._watchdog``                             the hang watchdog thread and its events
                                                    (``HANG_REPORTED``)
``mpar.comm._progress.PROGRESS``                    this rank's position and flight recorder
``mpar.comm._tp_ops._GROUPS``                       the tensor-parallel operators' groups
``mpar.comm._ep_ops._GROUPS``                       the expert-parallel operators' groups
``mpar.comm._ep_ops.TRAFFIC``                       the expert dispatch's byte and pair counts
``mpar.comm._cp_ops._GROUPS``                       the context-parallel operators' groups
``mpar.comm._shared._CREATED``                      the shared-memory files this process made
                                                    and has not removed (removed)
``mpar.comm._lifecycle._EXIT_HOOKED``               ``shutdown`` at exit and the failure
                                                    ``sys.excepthook``
==================================================  ============================================

Kept for the process's lifetime on purpose (never reset):

- ``mpar.comm._lifecycle._STORE`` and ``mpar.comm._lifecycle._GENERATION``: the job's
  rendezvous store and the count of ``init`` calls. A later ``init`` rendezvouses in
  the same store under a fresh prefix (a new store on the same port would race with a
  slower peer's old one); the hang watchdog's keys take the same generation.
- ``mpar.comm._process_state._PIECES``: this list, filled at import.
- Marks on the user's modules, which outlive an ``init``: the ``mpar.partition(i)``
  placements (``mpar.partition._manual._assignments``), the open contexts' stack
  (``mpar.partition._manual._state``) and registration hook
  (``mpar.partition._manual._Hook``), and the linear layers patched for the split
  backward (``mpar.runtime._split_backward._DEFERRING``).
- ``mpar.partition._traced._compiled``: a counter that keeps generated class names unique.
- ``mpar.testing._CONTEXT``: the test harness's process context (the parent process).
- ``mpar._streams._cuda``: each CUDA device's side streams (gathers, copies, reductions),
  made once and reused by every ``init``, as torch keeps its own streams.
- State that a ``with`` block sets and puts back on leaving it:
  ``mpar._streams._installed`` and ``mpar.testing.streams._LOGS`` (the recording seam
  of ``mpar.testing.streams.record_streams``) and ``mpar._device._debugging`` (inside
  a step under ``MPAR_SYNC_DEBUG``).
- Memoized pure functions (``functools.lru_cache`` in ``mpar.schedule._zero_bubble``,
  ``mpar.partition._planner``): their results depend on their arguments only.
- Process-wide settings ``init`` makes in torch: the seed and the thread count.

``tests/unit/test_process_state_list.py`` finds module-level state in the source and
checks that each piece is registered here or kept in this list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Piece", "pieces", "register", "reset_pieces"]


@dataclass(frozen=True)
class Piece:
    """One module-level piece of mutable process state."""

    name: str
    """Where it lives: ``module.NAME`` (or the module, for several names reset together)."""
    reset: Callable[[], None]
    """Puts it back to its value at import (``mpar.shutdown`` calls it)."""
    is_reset: Callable[[], bool]
    """Whether it holds its value at import."""
    teardown: bool
    """Reset after ``shutdown``'s final barrier (else before it, while the process
    groups are still usable)."""


_PIECES: list[Piece] = []


def register(
    name: str, reset: Callable[[], None], is_reset: Callable[[], bool], *, teardown: bool = False
) -> None:
    """List a piece of process state (at the import of the module that holds it)."""
    if all(p.name != name for p in _PIECES):
        _PIECES.append(Piece(name, reset, is_reset, teardown))


def pieces() -> list[Piece]:
    """Every registered piece, in the order ``shutdown`` resets them."""
    return [p for p in _PIECES if not p.teardown] + [p for p in _PIECES if p.teardown]


def reset_pieces(*, teardown: bool) -> None:
    """Reset the pieces of one phase of ``shutdown``, in registration order."""
    for piece in _PIECES:
        if piece.teardown == teardown:
            piece.reset()
