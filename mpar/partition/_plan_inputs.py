"""What the planner needs to know of a run, translated from a ``Config`` in one place.

:class:`PlanInputs` is the one record that the runtime (the partition at the first
step), ``mpar plan`` and the ``"auto"`` search hand to the planner
(``mpar.partition.make_plan``, ``mpar.partition.search``). :func:`plan_inputs` builds
it from a :class:`mpar.config.Config` and the job's grid (the runtime's
``Grid.shape``) or world size (``mpar plan --world-size``); nothing else turns config
keys into planner inputs, so what is planned and what runs read the same values.

The record is frozen and grouped as the config is: the grid's axes
(:class:`mpar.topology.GridShape`), the schedule (:class:`ScheduleSetup`), ZeRO
(:class:`ZeroSetup`), then precision, checkpointing, the device and its memory, the
partition objective, and what the model's tensor-parallel plan splits (measured from
the model, so given beside the config). A new config key the planner must honour is
one field here and one line of :func:`plan_inputs`; a new grid axis (``cp``, ``ep``)
is one field of ``GridShape`` (and the line of ``Config.grid_shape`` that reads its
key): ``PlanInputs.grid`` carries it to every reader.

What a plan needs besides the run (bandwidths and speed factors in a ``CostModel``,
the partition method, the microbatch size for ``--global-batch``) is given to
``make_plan`` beside this record: those are the CLI's, never the config's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeAlias

from mpar._size import parse_bytes
from mpar.config._schema import BlockCheckpointing
from mpar.errors import PartitionError
from mpar.partition._memory_model import (
    _PRECISIONS,
    DEVICES,
    Checkpointing,
    MemoryLayout,
    PlanDevice,
    _check_gather,
    effective_gather,
)
from mpar.partition._prediction import splits_backward
from mpar.schedule import PIPELINES
from mpar.schedule._csv import is_csv_path
from mpar.topology import GridShape

if TYPE_CHECKING:
    from mpar.config import Config, PrecisionKind
    from mpar.partition._cp_share import CPAttention, CPMethod
    from mpar.partition._ep_share import EPSplits
    from mpar.partition._tp_share import TPSplits

__all__ = [
    "ConfigDict",
    "PlanInputs",
    "ScheduleSetup",
    "ZeroSetup",
    "config_dict",
    "plan_device",
    "plan_inputs",
]

ConfigDict: TypeAlias = "dict[str, int | float | str | bool | ConfigDict | None]"
"""A config as ``mpar.config.load_config`` reads it (JSON-able)."""

OptimizeKind = Literal["speed", "memory"]


@dataclass(frozen=True)
class ScheduleSetup:
    """The pipeline schedule: the config keys of the same names."""

    pipeline: str = "interleaved"
    """A name in ``mpar.schedule.PIPELINES`` or the path of a schedule CSV."""
    virtual_stages: int = 1
    """Chunks per rank ``v`` (``pp * v`` stages)."""
    microbatches: int = 1
    """Microbatches per step ``m``."""
    active_microbatches: int | None = None
    """The cap on microbatches in flight the schedule is built with (None: none)."""
    split_backward: bool = True
    """Whether a schedule with I and W actions defers the weight gradients to W."""

    def __post_init__(self) -> None:
        for name in ("virtual_stages", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PartitionError(f"{name} must be a positive integer, got {value!r}")
        if self.pipeline not in PIPELINES and not is_csv_path(self.pipeline):
            raise PartitionError(
                f"pipeline must be one of {', '.join(PIPELINES)} or a schedule CSV; "
                f"got {self.pipeline!r}"
            )


@dataclass(frozen=True)
class ZeroSetup:
    """ZeRO sharding over each stage's data-parallel group (the config's ``zero``)."""

    stage: int = 0
    offload_optimizer: bool = False
    """Optimizer state (and the fp32 master copy) on the host."""
    offload_params: bool = False
    """Parameter shards on the host between uses (ZeRO-3)."""
    gather: str | int = "unit"
    """``zero.gather`` as configured (split-backward schedules gather by chunk anyway:
    ``effective_gather``)."""
    bucket_bytes: int = 25 * 2**20
    """One gradient-reduction bucket (``zero.bucket_mb``)."""
    prefetch: int = 1
    """ZeRO-3 groups gathered ahead (``zero.prefetch``)."""
    reduce: str = "microbatch"
    """When ZeRO 2/3 reduce-scatter by unit: ``"microbatch"`` or ``"step"`` (``zero.reduce``)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise PartitionError(f"zero stage must be 0, 1, 2 or 3, got {self.stage!r}")
        _check_gather(self.gather)


@dataclass(frozen=True)
class PlanInputs:
    """Everything about a run that changes its partition, memory and step time."""

    grid: GridShape = field(default_factory=GridShape)
    """The rank grid's axes: ``pp`` stages, ``dp`` replicas, ``tp`` ranks per layer,
    ``cp`` ranks per sequence."""
    schedule: ScheduleSetup = field(default_factory=ScheduleSetup)
    zero: ZeroSetup = field(default_factory=ZeroSetup)
    precision: PrecisionKind = "fp32"
    """"fp32", or "bf16" / "fp16" mixed precision (compute-dtype parameters, gradients
    and activations; fp32 master weights with the optimizer state)."""
    low_precision_grads: bool = False
    """Mixed precision: gradients accumulate and reduce in the compute dtype (config
    ``grad_reduce_dtype`` bf16 / fp16), not fp32."""
    activation_checkpointing: Checkpointing = False
    """True: stages keep only their inputs and recompute their chunk in backward;
    "block": every unit (block) keeps only its input and is recomputed alone, one at a
    time (the ``activation_checkpointing: "block"`` config value)."""
    device: PlanDevice = "cuda"
    """The device kind the ranks compute on; on "cpu" offloaded state counts in the
    rank's memory (``MemoryLayout.device``)."""
    device_memory: int | None = None
    """Bytes per rank the partition must fit (None: no cap)."""
    optimize: OptimizeKind = "speed"
    """The partition objective; sets the default ``memory_weight``."""
    memory_weight: float | None = None
    """Weight in [0, 1] of memory against compute in the partition cost (None: from
    ``optimize``: speed 0.2, memory 0.8)."""
    tp_splits: TPSplits | None = field(default=None, repr=False)
    """What the model's TP plan splits in each unit and the degrees it accepts
    (``mpar.partition._tp_share``); needed when ``grid.tp > 1``."""
    ep_splits: EPSplits | None = field(default=None, repr=False)
    """What the model's experts weigh and route in each unit
    (``mpar.partition._ep_share``); needed when ``grid.ep > 1``."""
    context_parallel_method: CPMethod = "ring"
    """How attention crosses the CP ranks (the config key): "ring" or "all_to_all"."""
    cp_attention: CPAttention | None = field(default=None, repr=False)
    """Where the model attends and at which sizes (``mpar.partition._cp_share``,
    measured by ``measure_attention``); needed when ``grid.cp > 1``."""

    def __post_init__(self) -> None:
        plan_device(self.device)
        if self.precision not in _PRECISIONS:
            raise PartitionError(
                f"precision must be one of {', '.join(_PRECISIONS)}, got {self.precision!r}"
            )

    def memory_layout(self, microbatch_scale: float = 1.0) -> MemoryLayout:
        """The knobs of the memory model for microbatches of ``microbatch_scale`` times
        the profiled one's samples: ZeRO 2/3 gathers as the runtime will
        (``effective_gather``), and a split backward counts what W keeps."""
        s, zero = self.schedule, self.zero
        split = s.split_backward and splits_backward(
            s.pipeline, self.grid.pp, s.virtual_stages, s.microbatches
        )
        return MemoryLayout(
            self.grid.dp * self.grid.cp,  # ZeRO shards and gradients reduce over dp x cp
            zero.stage,
            self.precision,
            self.activation_checkpointing,
            zero.offload_optimizer,
            zero.offload_params,
            microbatch_scale,
            bucket_bytes=zero.bucket_bytes,
            low_precision_grads=self.low_precision_grads and self.precision != "fp32",
            gather=effective_gather(s.pipeline, zero.gather),
            prefetch=zero.prefetch,
            reduce=zero.reduce,
            device=self.device,
            weight_work=split,
            expert_parallel_degree=self.grid.ep,
        )


def plan_device(kind: str) -> PlanDevice:
    """``kind`` ("cuda", "xla" or "cpu": a resolved device type) as a plan's device."""
    for known in DEVICES:
        if kind == known:
            return known
    raise PartitionError(
        f"device must be one of {', '.join(DEVICES)} (the kind the ranks compute on), got {kind!r}"
    )


def plan_inputs(
    config: Config,
    grid: GridShape | int,
    *,
    device: PlanDevice,
    tp_splits: TPSplits | None = None,
    ep_splits: EPSplits | None = None,
    cp_attention: CPAttention | None = None,
) -> PlanInputs:
    """The planner's inputs for ``config`` on ``grid``: the job's grid shape (the
    runtime's ``Grid.shape``, checked against the config's degrees) or its world size
    (``mpar plan --world-size``: data parallelism takes what pp x tp leave).

    ``device`` is the kind the ranks compute on (the config's ``device`` resolved:
    ``"auto"`` is CUDA where there is one); ``tp_splits`` what the model's TP plan
    splits (``mpar.tensor_parallel.measure_tp_splits``), needed at ``tp > 1``;
    ``ep_splits`` what its experts weigh (``mpar.expert_parallel.measure_ep_splits``),
    needed at ``ep > 1``.
    ``cp_attention`` where the model attends (``mpar.partition.measure_attention``),
    needed at ``cp > 1``.
    """
    shape = config.grid_shape(grid if isinstance(grid, int) else grid.world_size)
    if not isinstance(grid, int) and grid != shape:
        raise PartitionError(
            f"the grid {grid} is not the one the config lays out on its {shape.world_size} "
            f"ranks ({shape})"
        )
    zero = config.zero
    memory = config.device_memory
    return PlanInputs(
        grid=shape,
        schedule=ScheduleSetup(
            config.pipeline,
            config.virtual_stages,
            config.microbatches,
            config.active_microbatches,
            config.split_backward,
        ),
        zero=ZeroSetup(
            zero.stage,
            zero.offload_optimizer == "cpu",
            zero.offload_params == "cpu",
            zero.gather,
            int(zero.bucket_mb * 2**20),
            zero.prefetch,
            zero.reduce,
        ),
        precision=config.precision,
        low_precision_grads=config.low_precision_grads,
        activation_checkpointing=planned_checkpointing(config),
        device=device,
        device_memory=None if memory is None else parse_bytes(memory),
        optimize=config.optimize,
        memory_weight=config.memory_weight,
        tp_splits=tp_splits,
        ep_splits=ep_splits,
        context_parallel_method=config.context_parallel_method,
        cp_attention=cp_attention,
    )


def planned_checkpointing(config: Config) -> Checkpointing:
    """``activation_checkpointing`` as the planner models it: true by stage chunk,
    ``"block"`` for every block, the :class:`~mpar.config.BlockCheckpointing` itself
    for every k-th block or selectively (what the runtime runs, in each case)."""
    strategy = config.block_checkpointing
    if strategy is None:
        return config.chunk_checkpointing
    return "block" if strategy == BlockCheckpointing() else strategy


def _checkpointing_value(checkpointing: Checkpointing) -> bool | str | ConfigDict:
    """The config value of the planner's ``checkpointing`` (a dict for every k-th block
    or selective, as ``mpar.init`` takes it)."""
    if isinstance(checkpointing, BlockCheckpointing):
        return {"mode": checkpointing.mode, "every": checkpointing.every}
    return checkpointing


def config_dict(inputs: PlanInputs) -> ConfigDict:
    """The config dict that :func:`plan_inputs` turns back into ``inputs`` (less the
    device kind, the TP splits and the attention sizes, which are not config keys: ``device`` is left to
    the runtime's ``"auto"``, so a plan made for CUDA on a laptop runs as is)."""
    s, z = inputs.schedule, inputs.zero
    zero: ConfigDict = {"stage": z.stage}
    if z.offload_optimizer:
        zero["offload_optimizer"] = "cpu"
    if z.offload_params:
        zero["offload_params"] = "cpu"
    if z.gather != "unit":
        zero["gather"] = z.gather
    if z.bucket_bytes != ZeroSetup.bucket_bytes:
        zero["bucket_mb"] = z.bucket_bytes / 2**20
    if z.prefetch != ZeroSetup.prefetch:
        zero["prefetch"] = z.prefetch
    if z.reduce != ZeroSetup.reduce:
        zero["reduce"] = z.reduce
    config: ConfigDict = {
        "pipeline_parallel_degree": inputs.grid.pp,
        "tensor_parallel_degree": inputs.grid.tp,
        "microbatches": s.microbatches,
        "pipeline": s.pipeline,
        "virtual_stages": s.virtual_stages,
        "ddp": True,
        "zero": zero,
        "activation_checkpointing": _checkpointing_value(inputs.activation_checkpointing),
        "bf16": inputs.precision == "bf16",
        "fp16": inputs.precision == "fp16",
        "grad_reduce_dtype": inputs.precision if inputs.low_precision_grads else "fp32",
        "memory_weight": inputs.memory_weight,
    }
    if inputs.grid.ep > 1:
        config["expert_parallel_degree"] = inputs.grid.ep
    if inputs.optimize != "speed":
        config["optimize"] = inputs.optimize
    if s.active_microbatches is not None:
        config["active_microbatches"] = s.active_microbatches
    if not s.split_backward:
        config["split_backward"] = False
    if inputs.grid.cp > 1:
        config["context_parallel_degree"] = inputs.grid.cp
        config["context_parallel_method"] = inputs.context_parallel_method
    if inputs.device_memory is not None:
        config["device_memory"] = inputs.device_memory
    return config
