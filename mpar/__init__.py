"""mpar: model-parallel and sharding runtime for PyTorch.

See ``docs/`` and the README; the public names below are stable.
"""

from mpar import partition
from mpar._data import data_sampler
from mpar._ranks import (
    barrier,
    config,
    cp_rank,
    cp_size,
    dp_rank,
    dp_size,
    ep_rank,
    ep_size,
    local_rank,
    local_size,
    pp_rank,
    pp_size,
    rank,
    size,
    tp_rank,
    tp_size,
)
from mpar.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, wait_checkpoint
from mpar.checkpoint._pretrained import load_pretrained, save_pretrained
from mpar.comm import init, is_initialized, shutdown
from mpar.meta import materialize
from mpar.runtime import DistributedModel, DistributedOptimizer, StepOutput, memory_report, step

__version__ = "0.1.0.dev0"

__all__ = [
    "CheckpointError",
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "barrier",
    "config",
    "cp_rank",
    "cp_size",
    "data_sampler",
    "dp_rank",
    "dp_size",
    "ep_rank",
    "ep_size",
    "init",
    "is_initialized",
    "local_rank",
    "load_checkpoint",
    "load_pretrained",
    "local_size",
    "materialize",
    "memory_report",
    "partition",
    "pp_rank",
    "pp_size",
    "rank",
    "save_checkpoint",
    "save_pretrained",
    "shutdown",
    "size",
    "step",
    "tp_rank",
    "tp_size",
    "wait_checkpoint",
]
