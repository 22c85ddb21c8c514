"""Exception types raised by mpar.

Every error that comes from bad user input is a subclass of a built-in
``ValueError`` or ``TypeError`` so that ordinary ``except ValueError`` code keeps
working, and its message names what was wrong and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "AlreadyInitializedError",
    "BatchMismatchError",
    "ConfigError",
    "CommError",
    "ConfigTypeError",
    "ContextParallelError",
    "HangError",
    "MparError",
    "NotInitializedError",
    "PartitionError",
    "ScheduleError",
    "StepError",
]


class MparError(Exception):
    """Base class of every mpar exception."""


class ConfigError(MparError, ValueError):
    """A configuration key is unknown, out of range, or incompatible with another."""


class ConfigTypeError(MparError, TypeError):
    """A configuration value has the wrong type."""


class NotInitializedError(MparError, RuntimeError):
    """An mpar call needs ``mpar.init()`` first (or ``init`` was called twice)."""


class AlreadyInitializedError(MparError, RuntimeError):
    """``mpar.init()`` was called twice without ``mpar.shutdown()`` in between."""


class CommError(MparError, RuntimeError):
    """A transfer or collective failed or timed out (often: another rank failed)."""


class HangError(CommError):
    """A rank waited longer than ``timeout_s`` for a peer. The watchdog reports it
    under this name (the waiting thread is blocked and cannot raise it)."""


class ScheduleError(MparError, ValueError):
    """A pipeline schedule is impossible, invalid, or deadlocks."""


class PartitionError(MparError, ValueError):
    """A model cannot be split or no split fits the constraints."""


class StepError(MparError, RuntimeError):
    """A step function was used in a way mpar cannot execute."""


class BatchMismatchError(MparError, ValueError):
    """The ranks of one pipeline were given different batches (the data is sharded
    by global rank instead of by data-parallel rank)."""


class ContextParallelError(MparError, ValueError):
    """Context parallelism cannot apply to this model or this batch (a sequence that does
    not cut into 2 x cp pieces, heads the all-to-all cannot split, no attention found)."""
