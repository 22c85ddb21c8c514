"""The pipeline runtime: DistributedModel, DistributedOptimizer, @step, StepOutput."""

from mpar.runtime._distributed_optimizer import DistributedOptimizer
from mpar.runtime._memory_report import memory_report
from mpar.runtime._model import DistributedModel
from mpar.runtime._output import StepOutput
from mpar.runtime._step import step

__all__ = ["DistributedModel", "DistributedOptimizer", "StepOutput", "memory_report", "step"]
