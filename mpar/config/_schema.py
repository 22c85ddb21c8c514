"""Typed configuration: the dataclasses that every other mpar package reads.

Dicts exist only at the boundary (``mpar.config._boundary``); inside mpar the
configuration is a frozen :class:`Config`. Every field carries a docstring and
its own range check; checks that involve several fields live in
:meth:`Config.__post_init__`, and checks that need the world size in
:meth:`Config.check_world_size`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from mpar._size import parse_bytes
from mpar.errors import ConfigError, ConfigTypeError
from mpar.schedule._csv import is_csv_path
from mpar.schedule._generators import least_active_microbatches
from mpar.schedule._ir import Schedule
from mpar.schedule._registry import PIPELINES, SCHEDULE_HELP, check_csv_schedule
from mpar.topology import GridShape, placement_axes

__all__ = ["BlockCheckpointing", "Config", "PrecisionKind", "ZeroConfig"]

PipelineKind = str
"""A name in ``mpar.schedule.PIPELINES`` or the path of a schedule CSV file."""
OptimizeKind = Literal["speed", "memory"]
PlacementKind = str
"""``"cluster"``, ``"spread"``, or a permutation of the letters ``D``, ``P``, ``C``, ``T``
(or of ``D``, ``P``, ``T``; see :func:`placement_axes`)."""
OffloadKind = Literal["none", "cpu"]
DeviceKind = Literal["auto", "cpu", "cuda", "xla"]
BackendKind = Literal["auto", "gloo", "nccl", "xla", "mpi"]
CheckpointingKind = Literal["none", "each", "block", "selective"]
"""``activation_checkpointing`` as a word: off, each stage chunk, each block, each block
selectively (see :class:`BlockCheckpointing`)."""
BlockMode = Literal["block", "selective"]
ContextParallelMethod = Literal["ring", "all_to_all"]
PrecisionKind = Literal["fp32", "bf16", "fp16"]
"""What ``bf16`` / ``fp16`` choose: fp32, or that mixed precision."""
GradReduceKind = Literal["fp32", "bf16", "fp16"]
ReduceKind = Literal["microbatch", "step"]
"""When ZeRO 2/3 reduce-scatter gradients by unit (``zero.reduce``)."""
"""``grad_reduce_dtype``: fp32, or the compute dtype of that mixed precision."""

_EVERY_K = '{"mode": "block" | "selective", "every": k}'
"""How the error messages spell the dict form of ``activation_checkpointing``."""

#: Largest ``timeout_s`` (about 31 years): process-group timeouts must stay representable.
MAX_TIMEOUT_S = 1e9
#: Default ``memory_weight`` for each ``optimize`` objective (as in SageMaker model
#: parallelism): "speed" mostly balances compute, "memory" mostly balances memory. The
#: one definition; the partition solver reads it too.
MEMORY_WEIGHT_FOR = {"speed": 0.2, "memory": 0.8}


def _fail_choice(key: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"config key {key!r} has value {value!r}; allowed: {options}")


_PIPELINE_SYNONYMS = {
    "gpipe": "simple",
    "schedulegpipe": "simple",
    "1f1b": "interleaved",
    "schedule1f1b": "interleaved",
    "interleaved1f1b": "interleaved",
    "scheduleinterleaved1f1b": "interleaved",
    "zb": "zero_bubble",
    "zbh1": "zero_bubble",
    "zerobubble": "zero_bubble",
    "scheduleinterleavedzerobubble": "zero_bubble",
    "schedulezbvzerobubble": "zbv",
}
"""Other spellings of mpar's schedules (DeepSpeed's, torch's class names), for the hint."""


def _fail_pipeline(value: object) -> None:
    """``pipeline`` is neither a schedule name nor a CSV path: say which name was meant."""
    if value in PIPELINES:
        return
    options = ", ".join(repr(a) for a in PIPELINES)
    hint = ""
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "").replace("_", "").replace(" ", "")
        named = {p.replace("_", ""): p for p in PIPELINES}
        meant = named.get(key) or _PIPELINE_SYNONYMS.get(key)
        if meant is not None:
            hint = f" (did you mean {meant!r}: {SCHEDULE_HELP[meant]}?)"
    raise ConfigError(
        f"config key 'pipeline' has value {value!r}{hint}; allowed: {options}, or the path "
        "of a schedule CSV file (ending in .csv)"
    )


def _check_int(key: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(
            f"config key {key!r} must be an integer, got {type(value).__name__} {value!r}"
        )
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"config key {key!r} has value {value}; it must be >= {minimum}{upper}")


def _check_bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigTypeError(
            f"config key {key!r} must be true or false, got {type(value).__name__} {value!r}"
        )


def _check_number(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigTypeError(
            f"config key {key!r} must be a number, got {type(value).__name__} {value!r}"
        )


def _check_timeout(value: object) -> None:
    _check_number("timeout_s", value)
    seconds = float(value)  # type: ignore[arg-type]  # a number: checked just above
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        raise ConfigError(
            f"config key 'timeout_s' is {value}; it must be a finite number of seconds > 0 "
            f"and <= {MAX_TIMEOUT_S:g} (e.g. 300; a long wait is a large value, never inf or NaN)"
        )


def _check_trace(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ConfigTypeError(
            "config key 'trace' must be a directory path (a string) or null, got "
            f"{type(value).__name__} {value!r}"
        )
    if not value.strip():
        raise ConfigError("config key 'trace' is an empty path; give a directory or null")


def _check_memory(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigTypeError(
            f"config key 'device_memory' must be bytes (an integer) or a size such as "
            f"'16GiB', got {type(value).__name__} {value!r}"
        )
    try:
        nbytes = parse_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"config key 'device_memory': {exc}") from None
    if nbytes <= 0:
        raise ConfigError(f"config key 'device_memory' is {value!r}; it must be > 0")


def _device_memory_readable(config: Config) -> bool:
    """See ``mpar.config._boundary._readable``: checked by ``mpar.init`` on "auto"/"cuda"."""
    return config.device in ("auto", "cuda")


@dataclass(frozen=True)
class BlockCheckpointing:
    """Per-block activation checkpointing: ``activation_checkpointing`` given as
    ``"block"``, ``"selective"`` or ``{"mode": "block" | "selective", "every": k}``.

    The blocks are the partition units (a transformer block, the embedding, the head:
    what ``mpar.partition.find_units`` finds), at every pipeline degree."""

    mode: BlockMode = "block"
    """``"block"``: a checkpointed block keeps only its inputs and recomputes its whole
    forward in its backward. ``"selective"``: it also keeps the outputs of its matrix
    products and fused attention (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
    ``scaled_dot_product_*``), except a batched product whose result is larger than
    both of its operands (attention scores, sequence x sequence per head); it
    recomputes the rest (norms, activations, softmax, dropout, elementwise ops)."""

    every: int = 1
    """Checkpoint every ``every``-th block: the blocks ``0, every, 2 * every, ...`` of
    each stage, counted from the stage's first unit; 1 checkpoints every block."""

    def __post_init__(self) -> None:
        _fail_choice("activation_checkpointing.mode", self.mode, ("block", "selective"))
        _check_int("activation_checkpointing.every", self.every, minimum=1)

    def checkpoints(self, block: int) -> bool:
        """Whether the stage's ``block``-th unit (from 0) is checkpointed."""
        return block % self.every == 0


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO sharding across each pipeline stage's data-parallel group."""

    stage: int = 0
    """0: no sharding; 1: optimizer state; 2: + gradients; 3: + parameters."""

    offload_optimizer: OffloadKind = "none"
    """``"cpu"`` keeps optimizer state (and master weights) on the CPU and steps there."""

    offload_params: OffloadKind = "none"
    """``"cpu"`` keeps parameter shards on the CPU between uses (ZeRO stage 3 only)."""

    bucket_mb: float = 25.0
    """Size in MiB of the flat buckets used to reduce gradients and gather parameters."""

    reshard_after_forward: bool = True
    """ZeRO-3 (FSDP2's name): free a stage's gathered parameters between its forward
    and backward phases when other stages of this rank compute in between
    (GPipe schedules with ``virtual_stages`` > 1, also with one pipeline rank), and
    gather them again, prefetched, for the backward. False keeps each stage
    gathered from its first to its last action of the step: one gather instead
    of two, more memory."""

    gather: str | int = "unit"
    """ZeRO 2 and 3 inside a stage: ``"unit"`` gathers (at 3) and reduce-scatters one
    partition unit at a time, the next one prefetched; an int ``n`` works on groups of
    ``n`` consecutive units; ``"chunk"`` on the whole stage at once (fewer, larger
    collectives; the chunk's full parameters and gradients in memory)."""

    prefetch: int = 1
    """ZeRO-3 by unit or group: how many groups are gathered ahead of the one computing
    (the prefetch budget, in groups; FSDP2 and DeepSpeed prefetch too). Each runs on
    its own stream on CUDA, and the compute stream waits only for the group it is
    about to run. 0 gathers each group when it is needed; more overlaps better with
    slow links, for that many more groups' parameters in memory."""

    reduce: ReduceKind = "microbatch"
    """ZeRO 2 and 3 by unit or group: when gradients are reduce-scattered.
    ``"microbatch"`` after every backward of each group (only the group being
    differentiated holds full-size gradients: least memory, the gradients travel
    once per microbatch); ``"step"`` once per step (gradients accumulate full-size
    across microbatches, as by chunk, and travel once, overlapped with the last
    backward). By chunk, and at ZeRO 0-1, gradients are reduced once per step."""

    def __post_init__(self) -> None:
        _check_int("zero.stage", self.stage, minimum=0, maximum=3)
        _check_int("zero.prefetch", self.prefetch, minimum=0)
        _fail_choice("zero.reduce", self.reduce, ("microbatch", "step"))
        if self.gather not in ("unit", "chunk") and (
            isinstance(self.gather, bool) or not isinstance(self.gather, int) or self.gather < 1
        ):
            raise ConfigError(
                f"config key 'zero.gather' is {self.gather!r}; use \"unit\" (one partition "
                'unit at a time), "chunk" (a whole stage at once) or an int >= 1 '
                "(that many consecutive units at a time)"
            )
        _fail_choice("zero.offload_optimizer", self.offload_optimizer, ("none", "cpu"))
        _fail_choice("zero.offload_params", self.offload_params, ("none", "cpu"))
        _check_number("zero.bucket_mb", self.bucket_mb)
        if not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ConfigError(
                f"config key 'zero.bucket_mb' is {self.bucket_mb}; it must be a finite number "
                "of MiB > 0 (e.g. 25; one bucket per stage is a value above the stage's size)"
            )
        _check_bool("zero.reshard_after_forward", self.reshard_after_forward)
        if self.offload_params == "cpu" and self.stage != 3:
            raise ConfigError(
                f"config key 'zero.offload_params' is 'cpu' but 'zero.stage' is {self.stage}; "
                "parameter offload needs ZeRO stage 3: set zero.stage to 3 or offload_params to 'none'"
            )
        if self.offload_optimizer == "cpu" and self.stage == 0:
            raise ConfigError(
                "config key 'zero.offload_optimizer' is 'cpu' but 'zero.stage' is 0; "
                "optimizer offload needs ZeRO stage 1, 2 or 3"
            )


@dataclass(frozen=True)
class Config:
    """The resolved mpar configuration (``mpar.config()`` returns one)."""

    pipeline_parallel_degree: int = 1
    """Pipeline stages, i.e. ranks per pipeline (alias ``partitions``)."""

    tensor_parallel_degree: int = 1
    """Ranks that split each layer (the TP group, innermost in the rank grid; alias
    ``tp``). The ranks of a TP group take the same batch: dp = world / (pp * tp)."""

    context_parallel_degree: int = 1
    """Ranks that split each sequence (the CP group, right outside the TP group in the
    rank grid; alias ``cp``). The ranks of a CP group take the same batch and mpar shards
    its sequences, head-tail balanced: dp = world / (pp * cp * tp)."""

    context_parallel_method: ContextParallelMethod = "ring"
    """How attention sees the whole sequence under context parallelism: ``"ring"`` passes
    K/V around the CP group with an online-softmax merge; ``"all_to_all"`` (Ulysses)
    trades the sequence split for a head split around the unchanged attention."""

    tp_plan: dict[str, str] | None = field(default=None, hash=False)
    """Module-name patterns (``*`` = one name component) -> tensor-parallel style
    (``"colwise"``, ``"rowwise"``, ``"colwise_rep"``, ``"rowwise_rep"``,
    ``"embedding_rowwise"``, ``"packed_colwise:k"``, ``"replicate"``); None: the model's
    own ``base_model_tp_plan``, or mpar's plan for its family (see docs/tensor_parallel.md)."""

    expert_parallel_degree: int = 1
    """Ranks that split each mixture-of-experts layer's experts (alias ``ep``): folded into
    the data-parallel ranks (as Megatron-LM does), so it needs no extra ranks and must
    divide dp; attention and the dense layers keep the pp x dp x tp layout. Expert
    gradients and ZeRO state live on the expert-data-parallel group (the dp / ep ranks
    holding the same experts). See docs/expert_parallel.md."""

    ep_plan: dict[str, str] | None = field(default=None, hash=False)
    """Module-name patterns (``*`` = one name component) -> ``"experts"`` (split this
    experts module over the ep group) or ``"replicate"`` (keep it whole); None: the
    Hugging Face MoE blocks found by their structure (a router beside an experts
    module). See docs/expert_parallel.md for what an ``"experts"`` module must do."""

    microbatches: int = 1
    """Microbatches each step's batch is split into."""

    pipeline: PipelineKind = "interleaved"
    """``"interleaved"``: backward-first 1F1B; ``"simple"``: all forwards, then all backwards
    (GPipe); ``"zero_bubble"``: 1F1B with the backward split into input (I) and weight (W)
    parts, W deferred into the bubbles (ZB-H1; interleaved variant with virtual stages);
    ``"zbv"``: two stages per rank in a V (needs ``virtual_stages`` 2), split backward.
    The names come from ``mpar.schedule.PIPELINES``."""

    virtual_stages: int = 1
    """Model chunks per rank (looped stages, as in Megatron-LM's interleaved schedule)."""

    active_microbatches: int | None = None
    """Cap on microbatches in flight per rank (bounds activation memory); None: no cap."""

    split_backward: bool = True
    """Whether the I/W actions of the zero-bubble schedules split the backward (linear
    layers' weight gradients wait for W); false runs the whole backward in I and leaves
    W empty: the same gradients, an escape hatch (``MPAR_SPLIT_BACKWARD=0`` at init)."""

    optimize: OptimizeKind = "speed"
    """Partition objective; sets the default ``memory_weight`` (speed 0.2, memory 0.8)."""

    memory_weight: float | None = None
    """Weight in [0, 1] of memory versus compute in the partition cost; None: from ``optimize``."""

    auto_partition: bool = True
    """Partition from a profile; when false, modules go where ``mpar.partition(i)`` put them."""

    default_partition: int = 0
    """Stage of modules created outside any ``mpar.partition(i)`` when ``auto_partition`` is false."""

    placement_strategy: PlacementKind = "cluster"
    """How the pp, dp, cp and tp axes map onto global ranks: ``"cluster"`` (a pipeline's
    stages on consecutive ranks), ``"spread"`` (a data-parallel group's ranks
    consecutive), both with the TP group innermost and the CP group next to it; or a
    permutation of ``D``, ``P``, ``C``, ``T`` naming the axes outermost first
    (``"cluster"`` = ``"DPCT"``, ``"spread"`` = ``"PDCT"``; ``D``, ``P``, ``T`` alone put
    ``C`` just outside ``T``; see :func:`placement_axes`)."""

    ddp: bool = True
    """Data parallelism over the remaining ranks (dp = world size / pipeline degree)."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO sharding settings (see :class:`ZeroConfig`)."""

    activation_checkpointing: bool | CheckpointingKind | BlockCheckpointing = False
    """Recompute activations in backward: false / ``"none"``; true / ``"each"``: every
    stage chunk keeps only its inputs and recomputes its forward during its backward;
    ``"block"``, ``"selective"`` or ``{"mode": ..., "every": k}`` (a
    :class:`BlockCheckpointing` inside): block by block (see :attr:`block_checkpointing`)."""

    offload_activations: bool = False
    """Keep checkpointed activations on the CPU (needs ``activation_checkpointing``)."""

    bf16: bool = False
    """bfloat16 mixed precision."""

    fp16: bool = False
    """float16 mixed precision with dynamic loss scaling."""

    grad_reduce_dtype: GradReduceKind = "fp32"
    """Under ``bf16`` / ``fp16``: the dtype gradients accumulate (across microbatches and
    split backwards) and are reduced over data parallelism in. ``"fp32"`` (the default,
    as FSDP2's ``reduce_dtype`` and Megatron's fp32 gradient buffers) keeps the sums
    exact to fp32; ``"bf16"`` / ``"fp16"`` (the compute dtype itself) halves the
    gradient memory and the reduction's bytes at the cost of rounding every sum."""

    device: DeviceKind = "auto"
    """``auto`` picks cuda when available, else cpu."""

    backend: BackendKind = "auto"
    """``auto`` picks nccl on cuda and gloo on cpu; on xla, the XLA process group on TPU
    and Neuron without pipelining, else gloo with host staging (see docs/devices.md)."""

    seed: int = 0
    """One seed for every rank's initialisation."""

    timeout_s: float = 300.0
    """Seconds a rank may wait for a peer before mpar reports a hang: the rank that made
    no progress, its last action and its stack, and every rank's position (the
    transfers' own timeouts are longer, so this report comes first)."""

    shared_memory: bool = True
    """Pipeline transfers between ranks of one host go through shared-memory rings when
    they travel through host memory (gloo): no copy through the kernel, and no backend
    thread woken per message. False: through the backend, like every other transfer."""

    nccl_rules: bool = False
    """Pipeline transfers go through a test transport that enforces NCCL's point-to-point
    rules on gloo (tags ignored, per-pair order, a send completes only once matched,
    operations with one peer one after another unless grouped) and reports a mismatch or
    a deadlock between two ranks as an error: an order that would hang on GPUs fails on
    the CPU. Slow (three messages per transfer); for tests and for checking a custom
    schedule. Needs the gloo backend; the shared-memory rings are not used."""

    trace: str | None = None
    """Directory where each rank writes its flight recorder (its last actions with
    times, its position and stacks) when the job hangs or its step raises, and the
    reporting rank the hang report; None: nowhere (``MPAR_TRACE``, read at init, fills
    it in when unset)."""

    device_memory: int | str | None = None
    """Memory per rank (bytes, or "16GiB" / "40GB"): caps the partition and the "auto" planner."""

    auto_keys: tuple[str, ...] = ()
    """Keys the user gave as "auto" (their fields hold placeholders until the planner
    resolves them at the first step); set by the dict boundary, not a user key."""

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_combinations()

    def _check_schedule_file(self) -> None:
        from mpar.errors import ScheduleError
        from mpar.schedule._csv import read_csv

        try:
            schedule = read_csv(self.pipeline)
            check_csv_schedule(
                schedule,
                self.pipeline,
                self.pipeline_parallel_degree,
                self.microbatches,
                self.virtual_stages,
            )
        except ScheduleError as exc:
            raise ConfigError(f"config key 'pipeline': {exc}") from None
        self._check_file_within_cap(schedule)

    def _check_file_within_cap(self, schedule: Schedule) -> None:
        """A file runs in its own order: ``active_microbatches`` is not applied to it, so
        a file holding more pairs in flight than the cap is refused, not run past it."""
        from mpar.schedule._simulate import peak_in_flight

        k = self.active_microbatches
        if k is None:
            return
        peaks = peak_in_flight(schedule)
        rank = max(range(len(peaks)), key=peaks.__getitem__)
        if peaks[rank] > k:
            raise ConfigError(
                f"config key 'active_microbatches' is {k}, but the schedule in "
                f"{self.pipeline!r} holds {peaks[rank]} (stage, microbatch) pairs in flight "
                f"on rank {rank}; mpar runs a file's order as written: set "
                f"active_microbatches to {peaks[rank]} or more (or drop it), or write a "
                "schedule that holds fewer"
            )

    def _check_fields(self) -> None:
        _check_int("pipeline_parallel_degree", self.pipeline_parallel_degree, minimum=1)
        _check_int("microbatches", self.microbatches, minimum=1)
        _check_int("tensor_parallel_degree", self.tensor_parallel_degree, minimum=1)
        _check_int("context_parallel_degree", self.context_parallel_degree, minimum=1)
        _fail_choice(
            "context_parallel_method", self.context_parallel_method, ("ring", "all_to_all")
        )
        _check_tp_plan(self.tp_plan)
        _check_int("expert_parallel_degree", self.expert_parallel_degree, minimum=1)
        _check_ep_plan(self.ep_plan)
        _check_cp_with_ep(self.context_parallel_degree, self.expert_parallel_degree)
        if not is_csv_path(self.pipeline):
            _fail_pipeline(self.pipeline)
        _check_int("virtual_stages", self.virtual_stages, minimum=1)
        if self.active_microbatches is not None:
            _check_int("active_microbatches", self.active_microbatches, minimum=1)
        _fail_choice("optimize", self.optimize, ("speed", "memory"))
        if self.memory_weight is not None:
            _check_number("memory_weight", self.memory_weight)
            if not 0.0 <= self.memory_weight <= 1.0:
                raise ConfigError(
                    f"config key 'memory_weight' has value {self.memory_weight}; "
                    "it must be in [0, 1] (or null to follow 'optimize')"
                )
        for key in (
            "split_backward",
            "auto_partition",
            "ddp",
            "offload_activations",
            "bf16",
            "fp16",
            "shared_memory",
            "nccl_rules",
        ):
            _check_bool(key, getattr(self, key))
        _check_int("default_partition", self.default_partition, minimum=0)
        placement_axes(self.placement_strategy)
        if not isinstance(self.activation_checkpointing, bool | BlockCheckpointing):
            _fail_choice(
                "activation_checkpointing",
                self.activation_checkpointing,
                (True, False, "none", "each", "block", "selective", _EVERY_K),
            )
        _fail_choice("device", self.device, ("auto", "cpu", "cuda", "xla"))
        _fail_choice("backend", self.backend, ("auto", "gloo", "nccl", "xla", "mpi"))
        _check_int("seed", self.seed, minimum=0)
        _check_memory(self.device_memory)
        _check_timeout(self.timeout_s)
        _check_trace(self.trace)

    def _check_active_microbatches(self) -> None:
        """A cap above the microbatches, or below what the schedule must hold before its
        first backward."""
        k, keys = self.active_microbatches, self.auto_keys
        if k is None:
            return
        if "microbatches" not in keys and k > self.microbatches:
            raise ConfigError(
                f"config key 'active_microbatches' is {k} but there are only "
                f"{self.microbatches} microbatches; use a value <= {self.microbatches}"
            )
        if {"pipeline_parallel_degree", "virtual_stages", "pipeline"} & set(keys):
            return
        pp, v = self.pipeline_parallel_degree, self.virtual_stages
        least = least_active_microbatches(self.pipeline, pp, v)
        if k < least:
            raise ConfigError(
                f"config key 'active_microbatches' is {k}, but the {self.pipeline} schedule "
                f"with pipeline_parallel_degree {pp} and virtual_stages {v} must hold {least} "
                "(stage, microbatch) pairs on a rank before its first backward: use "
                f"active_microbatches >= {least}, or fewer virtual_stages"
            )

    def _check_combinations(self) -> None:
        if self.nccl_rules and self.backend not in ("auto", "gloo"):
            raise ConfigError(
                f"config key 'nccl_rules' is true but 'backend' is {self.backend!r}: the rules "
                "are enforced on gloo (on NCCL they are the real thing); set backend 'gloo' or "
                "'auto' on the CPU, or drop 'nccl_rules'"
            )
        if self.bf16 and self.fp16:
            raise ConfigError(
                "config keys 'bf16' and 'fp16' are both true; choose one mixed-precision mode"
            )
        self._check_grad_reduce_dtype()
        if self.default_partition >= self.num_stages:
            raise ConfigError(
                f"config key 'default_partition' is {self.default_partition} but there are only "
                f"{self.num_stages} stages (pipeline_parallel_degree x virtual_stages); "
                f"use a value below {self.num_stages}"
            )
        if self.offload_activations and not self.checkpointing:
            raise ConfigError(
                "config key 'offload_activations' is true but 'activation_checkpointing' is off; "
                "offloading keeps checkpointed activations, so turn checkpointing on"
            )
        if self.auto_keys and self.device_memory is None and not _device_memory_readable(self):
            raise ConfigError(
                f"config keys {list(self.auto_keys)} are 'auto' but 'device_memory' is not set"
            )
        self._check_active_microbatches()
        pp, v, m = self.pipeline_parallel_degree, self.virtual_stages, self.microbatches
        if is_csv_path(self.pipeline):
            self._check_schedule_file()
        if self.pipeline == "zbv" and v != 2:
            raise ConfigError(
                f"config key 'virtual_stages' is {v}, but pipeline 'zbv' places two stages on "
                "every rank in a V: set virtual_stages to 2"
            )
        if self.pipeline in ("interleaved", "zero_bubble") and v > 1 and m % pp:
            fits = sorted({pp * max(1, m // pp), pp * (m // pp + 1)})
            raise ConfigError(
                f"config key 'microbatches' is {m}: the {self.pipeline} schedule with "
                f"{v} virtual stages needs a multiple of pipeline_parallel_degree {pp}; "
                f"use {' or '.join(map(str, fits))} (or pipeline 'simple')"
            )
        if self.backend == "xla" and self.device != "xla":
            raise ConfigError(
                f"config key 'backend' is 'xla' but 'device' is {self.device!r}; the XLA "
                "process group carries XLA tensors: set device 'xla' (or backend 'auto')"
            )
        if self.backend == "xla" and pp > 1:
            raise ConfigError(
                f"config key 'backend' is 'xla' with pipeline_parallel_degree {pp}: XLA "
                "collectives need every rank to run the same program, which pipeline stages "
                "do not; use backend 'gloo' or 'auto' (host-staged, see docs/devices.md)"
            )
        if self.device == "xla" and self.tensor_parallel_degree > 1:
            raise ConfigError(
                f"config key 'tensor_parallel_degree' is {self.tensor_parallel_degree} with "
                "device 'xla': tensor parallelism runs on cpu and cuda only for now; use "
                "pipeline and data parallelism (and ZeRO) on XLA"
            )
        if self.device == "xla" and self.expert_parallel_degree > 1:
            raise ConfigError(
                f"config key 'expert_parallel_degree' is {self.expert_parallel_degree} with "
                "device 'xla': expert parallelism runs on cpu and cuda only for now; use "
                "expert_parallel_degree 1 (experts replicated, ZeRO shards them) on XLA"
            )
        if self.device == "xla" and self.context_parallel_degree > 1:
            raise ConfigError(
                f"config key 'context_parallel_degree' is {self.context_parallel_degree} with "
                "device 'xla': context parallelism runs on cpu and cuda only for now"
            )
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(
                "config key 'backend' is 'nccl' but 'device' is 'cpu'; NCCL needs CUDA: "
                "use backend 'gloo' (or 'auto') on the CPU"
            )

    def _check_grad_reduce_dtype(self) -> None:
        _fail_choice("grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16", "fp16"))
        if self.grad_reduce_dtype not in ("fp32", self.precision):
            fix = (
                f"'fp32', or set '{self.grad_reduce_dtype}': true"
                if self.precision == "fp32"
                else f"'fp32' or {self.precision!r}"
            )
            raise ConfigError(
                f"config key 'grad_reduce_dtype' is {self.grad_reduce_dtype!r} but the "
                f"precision is {self.precision!r}: gradients reduce in fp32 or in the compute "
                f"dtype; set 'grad_reduce_dtype' to {fix}"
            )

    @property
    def low_precision_grads(self) -> bool:
        """Whether gradients accumulate and reduce in the compute dtype (bf16 / fp16)
        rather than fp32 (``grad_reduce_dtype``)."""
        return self.grad_reduce_dtype != "fp32"

    @property
    def num_stages(self) -> int:
        """Total pipeline stages: pipeline degree x virtual stages."""
        return self.pipeline_parallel_degree * self.virtual_stages

    @property
    def precision(self) -> PrecisionKind:
        """``"bf16"`` or ``"fp16"`` under that mixed precision, else ``"fp32"``."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def checkpointing(self) -> bool:
        """Whether activations are recomputed in backward (``activation_checkpointing``
        anything but false / ``"none"``)."""
        return self.activation_checkpointing not in (False, "none")

    @property
    def chunk_checkpointing(self) -> bool:
        """Whether each stage chunk is recomputed whole (true / ``"each"``)."""
        return self.activation_checkpointing in (True, "each")

    @property
    def block_checkpointing(self) -> BlockCheckpointing | None:
        """The per-block strategy (``"block"``, ``"selective"``, a dict), else None."""
        value = self.activation_checkpointing
        if isinstance(value, BlockCheckpointing):
            return value
        if value in ("block", "selective"):
            return BlockCheckpointing(mode=value)
        return None

    def grid_shape(self, world_size: int) -> GridShape:
        """The rank grid of this layout on ``world_size`` ranks (checked against it):
        data parallelism takes what the other axes leave."""
        self.check_world_size(world_size)
        return GridShape.for_world(
            world_size,
            pp=self.pipeline_parallel_degree,
            tp=self.tensor_parallel_degree,
            ep=self.expert_parallel_degree,
            cp=self.context_parallel_degree,
        )

    @property
    def resolved_memory_weight(self) -> float:
        """``memory_weight``, or the default of the ``optimize`` objective."""
        if self.memory_weight is not None:
            return float(self.memory_weight)
        return MEMORY_WEIGHT_FOR[self.optimize]

    def check_world_size(self, world_size: int) -> None:
        """Raise ConfigError if this layout cannot run on ``world_size`` processes."""
        if "pipeline_parallel_degree" in self.auto_keys:
            raise ConfigError(
                "config key 'pipeline_parallel_degree' is 'auto', but the pipeline degree decides "
                "the process grid at mpar.init, before the model is known; run `mpar plan --auto "
                f"--world-size {world_size} ...` and put its pipeline_parallel_degree in the "
                "config (microbatches, virtual_stages, zero.stage and activation_checkpointing "
                "may stay 'auto': they are resolved at the first step)"
            )
        pp, tp = self.pipeline_parallel_degree, self.tensor_parallel_degree
        cp = self.context_parallel_degree
        # the outer axis first: each hint below lists the degrees that fit inside it
        if world_size % pp != 0:
            raise ConfigError(
                f"config key 'pipeline_parallel_degree' is {pp} but the world size is {world_size}; "
                f"the pipeline degree must divide the world size (try one of "
                f"{_divisors(world_size)})"
            )
        if world_size % (pp * tp) != 0:
            raise ConfigError(
                f"config keys 'pipeline_parallel_degree' {pp} x 'tensor_parallel_degree' {tp} "
                f"= {pp * tp} do not divide the world size {world_size}; every pipeline stage "
                f"needs a whole TP group (try a tensor_parallel_degree in "
                f"{_divisors(world_size // pp)})"
            )
        if world_size % (pp * cp * tp) != 0:
            raise ConfigError(
                f"config keys 'pipeline_parallel_degree' {pp} x 'context_parallel_degree' {cp} "
                f"x 'tensor_parallel_degree' {tp} = {pp * cp * tp} do not divide the world size "
                f"{world_size}; every pipeline stage needs whole CP and TP groups (try a "
                f"context_parallel_degree in {_divisors(world_size // (pp * tp))})"
            )
        dp = world_size // (pp * cp * tp)
        if dp > 1 and not self.ddp:
            raise ConfigError(
                f"world size {world_size} with pipeline_parallel_degree {pp} "
                f"(context_parallel_degree {cp}, tensor_parallel_degree {tp}) leaves {dp} "
                "data-parallel replicas but 'ddp' is false; set 'ddp' to true or "
                f"pipeline_parallel_degree to {world_size}"
            )
        self._check_expert_fold(world_size, dp)

    def _check_expert_fold(self, world_size: int, dp: int) -> None:
        """Expert parallelism folds into the data-parallel ranks: ep must divide them."""
        ep = self.expert_parallel_degree
        if dp % ep:
            pp, tp = self.pipeline_parallel_degree, self.tensor_parallel_degree
            raise ConfigError(
                f"config key 'expert_parallel_degree' is {ep}, but the world size {world_size} "
                f"/ (pipeline_parallel_degree {pp} x tensor_parallel_degree {tp}) leaves "
                f"{dp} data-parallel rank(s), and expert parallelism folds into them (it "
                f"takes no ranks of its own): use an expert_parallel_degree in "
                f"{_divisors(dp)}, or more ranks"
            )

    def to_dict(self) -> dict[str, object]:
        """The configuration as canonical keys (JSON-able); unresolved keys read "auto"."""
        data = dataclasses.asdict(self)
        auto = data.pop("auto_keys")
        for key in auto:
            section, _, name = key.rpartition(".")
            (data[section] if section else data)[name] = "auto"
        return data


def _check_tp_plan(plan: object) -> None:
    if plan is None:
        return
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    ):
        raise ConfigTypeError(
            f"config key 'tp_plan' must be a dict from module-name patterns to style names "
            f"(e.g. {{'blocks.*.attn.q': 'colwise'}}) or null, got {plan!r}"
        )
    from mpar._tp_styles import parse_style

    for pattern, style in plan.items():
        parse_style(style, f"config key 'tp_plan' entry {pattern!r}")


def _check_cp_with_ep(cp: int, ep: int) -> None:
    """Context and expert parallelism each work alone; together they would need ep groups
    inside each cp coordinate and expert ZeRO groups over edp x cp, not built yet."""
    if cp > 1 and ep > 1:
        raise ConfigError(
            f"context_parallel_degree and expert_parallel_degree > 1 together are not "
            f"supported yet (got context_parallel_degree {cp}, expert_parallel_degree {ep}); "
            "set one of them to 1: context parallelism for long sequences, expert "
            "parallelism for MoE layers"
        )


def _check_ep_plan(plan: object) -> None:
    if plan is None:
        return
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    ):
        raise ConfigTypeError(
            "config key 'ep_plan' must be a dict from module-name patterns to 'experts' or "
            f"'replicate' (e.g. {{'blocks.*.moe.experts': 'experts'}}) or null, got {plan!r}"
        )
    for pattern, style in plan.items():
        if style not in ("experts", "replicate"):
            raise ConfigError(
                f"config key 'ep_plan' entry {pattern!r} has value {style!r}; allowed: "
                "'experts' (split this experts module over the ep group), 'replicate' "
                "(keep it whole on every rank)"
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
