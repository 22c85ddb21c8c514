"""DistributedModel: an ordinary nn.Module, partitioned across pipeline ranks.

The module is split lazily, at the first call inside a ``@mpar.step`` function
(or at construction when ``example_inputs`` is given): rank 0 profiles it on one
microbatch and solves the partition, every rank splits it identically, keeps
its own stages and frees the parameters of the others.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpar._cp_context import current, using
from mpar.comm import ProcessGrid, State
from mpar.comm._collectives import (
    all_gather_object_ep,
    all_gather_object_pp,
    all_gather_object_tp,
    all_reduce_pp,
)
from mpar.comm._lifecycle import session
from mpar.config import Config
from mpar.context_parallel import (
    FOUND,
    CallPlan,
    check_found,
    check_heads,
    install_hf,
    prepare_call,
    replace_sdpa,
)
from mpar.errors import StepError
from mpar.expert_parallel import EPLayout
from mpar.partition import Plan
from mpar.runtime._adapt import disable_caches
from mpar.runtime._batch_check import batch_check_due
from mpar.runtime._buffer_sync import ReplicaBuffers
from mpar.runtime._executor import Args, Captured, Kwargs, StepCalls, StepRun
from mpar.runtime._local_stages import LocalStages, build_local_stages
from mpar.runtime._microbatch import Microbatches
from mpar.runtime._placement import MeasuredPlacement
from mpar.runtime._recompute import checkpoint_blocks
from mpar.runtime._sharding import gathered, make_sharded, stage_units
from mpar.runtime._transfers import step_signature
from mpar.schedule import Schedule
from mpar.shard import ShardedStages
from mpar.tensor_parallel import TPLayout, TPShard

__all__ = ["DistributedModel", "StateKeys", "StepFunction"]

StepFunction = Callable[..., object]
"""A ``@mpar.step`` function: ``fn(model, *args, **kwargs)``, run once per microbatch."""


def _check_axes(axes: object) -> tuple[int, ...]:
    if isinstance(axes, int) or not isinstance(axes, Sequence):
        raise TypeError(f"dynamic_axes must be a tuple of axis numbers, got {axes!r}")
    if not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in axes):
        raise ValueError(f"dynamic_axes must hold axis numbers >= 0, got {axes!r}")
    return tuple(axes)


@dataclass(frozen=True)
class StateKeys:
    """The original module's tensors, recorded before partitioning frees any: what
    ``state_dict``, checkpoints and pretrained files are keyed and shaped by."""

    order: tuple[str, ...]
    """The module's state-dict keys, in its order."""
    dtypes: Mapping[str, torch.dtype]
    shapes: Mapping[str, torch.Size]
    """Each state-dict key's full shape (not a tensor-parallel piece)."""
    aliases: Mapping[str, tuple[str, ...]]
    """For each key, the other keys naming the same tensor (tied weights)."""
    named_shapes: Mapping[str, torch.Size]
    """Every parameter and buffer (non-persistent ones too) under each of its names."""

    @classmethod
    def of(cls, module: nn.Module) -> StateKeys:
        from mpar.meta import tensor_shapes

        state = module.state_dict(keep_vars=True)
        by_tensor: dict[int, list[str]] = {}
        for key, tensor in state.items():
            by_tensor.setdefault(id(tensor), []).append(key)
        return cls(
            order=tuple(state),
            dtypes={k: v.dtype for k, v in state.items()},
            shapes={k: v.shape for k, v in state.items()},
            aliases={
                k: tuple(a for a in keys if a != k) for keys in by_tensor.values() for k in keys
            },
            named_shapes=tensor_shapes(module),
        )

    def names_of(self, key: str) -> tuple[str, ...]:
        """``key`` and its aliases."""
        return (key, *self.aliases.get(key, ()))


@dataclass
class _Capture:
    """While the step function runs only up to ``model(...)``: that call's inputs."""

    active: bool = False
    inputs: tuple[Args, Kwargs] | None = None


@dataclass
class _CPModel:
    """Under context parallelism: how the model's calls get global positions and shifted
    labels, whether Hugging Face's attention interface was pointed at mpar's, and
    whether the first step must still check that attention was found."""

    calls: CallPlan
    hf: bool
    unchecked: bool = False


class _Steps:
    """What the model keeps from step to step: its lowered schedules (training and
    forward-only), the measured placement of zero-bubble W actions, how many steps
    were due for the same-batch check, and the partition's buffers that steps average
    over the replicas (batch-norm statistics)."""

    def __init__(self) -> None:
        self.schedules: dict[bool, Schedule] = {}
        self.placement = MeasuredPlacement()
        self.batch_checks = 0
        self.buffers: tuple[LocalStages, ReplicaBuffers] | None = None


@dataclass(frozen=True)
class _ModelOptions:
    """What the user chose when wrapping the model."""

    dynamic_axes: tuple[int, ...]
    """Axes of every tensor input whose size may change between steps in a captured
    pipeline (``(0,)`` the batch; ``(0, 1)`` also the sequence)."""
    init_fn: Callable[[nn.Module], None] | None
    """A meta-built model: called on each module to initialise it (default: its own
    initialisers; see ``mpar.meta``)."""


@dataclass(frozen=True)
class _Adapted:
    """What mpar changed on, or noted of, the user's module when wrapping it."""

    caches_disabled: list[str]
    """Names of the submodules whose ``config.use_cache`` mpar turned off (``runtime._adapt``)."""
    wrapped_names: dict[int, str]
    """``id(parameter) -> name`` of the module as wrapped (expert parallelism takes the
    experts other ranks hold out of this rank's module)."""


class DistributedModel:
    """Wraps ``module`` for pipeline and data-parallel execution.

    Inside a step, ``model(...)`` runs the model and ``model.backward(loss)``
    replaces ``loss.backward()``. ``state_dict()`` gathers the full model with
    the original module's keys; ``local_state_dict()`` is this rank's share.
    """

    def __init__(
        self,
        module: nn.Module | Callable[[], nn.Module],
        *,
        example_inputs: object = None,
        example_kwargs: Mapping[str, object] | None = None,
        dynamic_axes: Sequence[int] = (0,),
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        from mpar.meta import build_module

        module = build_module(module)
        self.options = _ModelOptions(_check_axes(dynamic_axes), init_fn)
        process = session()
        self._run = process.state
        self.module = module
        self.state_keys = StateKeys.of(module)
        """The original module's state-dict keys, dtypes and shapes (see :class:`StateKeys`)."""
        self.after_partition: list[Callable[[DistributedModel], None]] = []
        """Run once the model is partitioned (a deferred ``mpar.load_pretrained``). A hook
        with an ``overwrites`` attribute (state-dict keys) overwrites those tensors whole:
        a meta model leaves them uninitialised."""
        self.stages: LocalStages | None = None
        self.sharded: ShardedStages | None = None
        self.activation_peak_bytes = 0
        """Peak bytes of stage inputs/outputs kept for backward during the last step."""
        self.active_run: StepRun | None = None
        self._capture = _Capture()
        self._steps = _Steps()
        self.adapted = _Adapted(
            disable_caches(module), {id(p): n for n, p in module.named_parameters()}
        )
        self.tp_layout: TPLayout | None = _tp_layout(module, self.grid, self.config)
        """How tensor parallelism splits this model (None at tensor_parallel_degree 1)."""
        self.ep_layout: EPLayout | None = _ep_layout(module, self.grid, self.config, self.tp_layout)
        """How expert parallelism splits this model's experts (None at ep degree 1)."""
        self._cp: _CPModel | None = None
        if self.grid.cp_size > 1:
            method = self.config.context_parallel_method
            check_heads(module, self.grid.cp_size, self.grid.tp_size, method)
            self._cp = _CPModel(CallPlan(module), install_hf(module, method))
        process.models.add(self)
        if example_inputs is not None or example_kwargs is not None:
            args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            self._partition(tuple(a for a in args if a is not None), dict(example_kwargs or {}))

    @property
    def run_state(self) -> State:
        """What the runtime gets: the state of ``mpar.init`` with this model's config
        (one object, made again only when :attr:`config` changes)."""
        return self._run

    @property
    def grid(self) -> ProcessGrid:
        """The rank grid and process groups this model runs on."""
        return self._run.grid

    @property
    def config(self) -> Config:
        """The configuration this model runs with: ``mpar.config()``, with its ``"auto"``
        values resolved at the first step."""
        return self._run.config

    @config.setter
    def config(self, config: Config) -> None:
        self._run = self._run.with_config(config)

    @property
    def placement(self) -> MeasuredPlacement:
        """The measured placement of zero-bubble W actions (its costs, ratios, choice)."""
        return self._steps.placement

    def due_batch_check(self) -> bool:
        """Count a step; whether it is one whose batch is checked (the first
        ``FIRST_STEPS`` steps, then every ``EVERY``: ``runtime._batch_check``)."""
        calls = self._steps.batch_checks
        self._steps.batch_checks = calls + 1
        return batch_check_due(calls)

    # -- partitioning --------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self.stages is not None

    def _partition(self, args: Args, kwargs: Kwargs, profiled_cp: int = 1) -> None:
        """Partition from one microbatch's inputs, their sequences already cut by
        ``profiled_cp`` (the first step's: this rank's share; example inputs: whole)."""
        from mpar.meta import start_materialize

        st = self._run
        FOUND["calls"] = 0
        self.stages = build_local_stages(
            self.module,
            args,
            kwargs,
            st,
            dynamic_axes=self.options.dynamic_axes,
            tp=self.tp_layout,
            ep=self.ep_layout,
            capture_whole=self._cp is not None and not self._cp.hf,
            profiled_cp=profiled_cp,
        )
        if self._cp is not None:
            self._replace_attention(self.stages)
        for stage in self.stages.modules.values():
            stage.train(self.module.training)
        self._checkpoint_blocks(self.stages, (args, kwargs))
        # A meta model gets storage here: this rank's stages only, bucket by bucket.
        overwritten = {k for h in self.after_partition for k in getattr(h, "overwrites", ())}
        materializer = start_materialize(
            self.module,
            self.stages,
            st,
            self.options.init_fn,
            self.state_keys.named_shapes,
            overwritten,
            self._cuts(),
        )
        ensure = None if materializer is None else materializer.ensure_or_defer
        self.sharded = make_sharded(self.stages, st, (args, kwargs), materialize=ensure)
        if materializer is not None:
            materializer.finish()
        hooks, self.after_partition = self.after_partition, []
        for hook in hooks:
            hook(self)
        _refuse_released_calls(self)

    def _checkpoint_blocks(self, stages: LocalStages, example: tuple[Args, Kwargs]) -> None:
        """Per-block activation checkpointing: every local stage's chosen units recompute
        one by one (``runtime._recompute``); a stage that is the whole model learns its
        units from ``example`` (the first microbatch's inputs)."""
        strategy = self.config.block_checkpointing
        if strategy is None:
            return
        for s, stage in stages.modules.items():
            units = stage_units(stages, s, self._run, example)
            if units and s < len(stages.unit_names):
                stages.unit_names[s] = units  # found once: ZeRO's unit groups read them
            stages.checkpointed[s] = checkpoint_blocks(stage, units, strategy)

    def _replace_attention(self, stages: LocalStages) -> None:
        """Context parallelism: point the stages' attention at the CP operators (Hugging
        Face's already is, since ``__init__``); every rank of the pipeline learns whether
        the model had any."""
        method = self.config.context_parallel_method
        found = FOUND["calls"]
        for s, stage in stages.modules.items():
            found += replace_sdpa(stage, method, f"stage {s} of {type(self.module).__name__}")
        if stages.num_stages == 1 and not hasattr(stages.modules[0], "programs"):
            assert self._cp is not None
            self._cp.unchecked = True  # the model itself: its calls are counted as it runs
            return
        total = torch.tensor([found], dtype=torch.long)
        all_reduce_pp(total, self.grid)
        check_found(int(total.item()), self.module)

    def ensure_partitioned(self, fn: StepFunction, batches: Microbatches) -> None:
        if self.stages is None:
            args, kwargs = self.capture(fn, batches, 0)
            self._partition(args, kwargs, self.grid.cp_size)

    @property
    def plan(self) -> Plan | _ManualPlan | None:
        """The partition plan (stages, units, profiled cost and memory, bubble)."""
        if self.stages is None:
            return None
        return self.stages.plan if self.stages.plan is not None else _ManualPlan(self.stages)

    def schedule(self, forward_only: bool) -> Schedule:
        """This model's pipeline schedule (training, or forward-only), lowered exactly as
        this rank executes it (``mpar.schedule.executable_schedule``)."""
        schedules = self._steps.schedules
        if forward_only not in schedules:
            from mpar.schedule import executable_schedule

            cfg = self.config
            schedules[forward_only] = executable_schedule(
                cfg.pipeline,
                cfg.pipeline_parallel_degree,
                cfg.microbatches,
                virtual_stages=cfg.virtual_stages,
                active_microbatches=cfg.active_microbatches,
                forward_only=forward_only,
                zero_stage=None if self.sharded is None else cfg.zero.stage,
                reshard_gap=1 if cfg.zero.reshard_after_forward else None,
            )
        return schedules[forward_only]

    def _lowered(self, schedule: Schedule) -> Schedule:
        """``schedule`` lowered as :meth:`schedule` lowers the configured one."""
        from mpar.schedule import lower

        cfg = self.config
        return lower(
            schedule,
            zero_stage=None if self.sharded is None else cfg.zero.stage,
            reshard_gap=1 if cfg.zero.reshard_after_forward else None,
        )

    def run_step(self, fn: StepFunction, batches: Microbatches) -> StepRun:
        """Run one step of ``fn`` over ``batches`` on this rank; returns the finished run
        (its ``outputs``, ``timeline`` and ``schedule``)."""
        self.ensure_partitioned(fn, batches)
        assert self.stages is not None
        training = torch.is_grad_enabled()
        if training:
            _check_gradients_cleared(self.sharded)
        run = StepRun(
            self.stages,
            self.sharded,
            self.schedule(forward_only=not training),
            batches,
            self._run,
            StepCalls(
                call=lambda j: fn(self, *batches.args[j], **batches.kwargs[j]),
                capture=lambda j: self.capture(fn, batches, j),
                name=getattr(fn, "__name__", repr(fn)),
            ),
            record=self._steps.placement.records(self._run, training),
            signature=step_signature(self._steps, fn, batches, training),
        )
        self.active_run = run  # model(...) and model.backward(loss) go to it
        try:
            run.run()
        finally:
            self.active_run = None
        self._replica_buffers().average(self.grid)  # batch-norm statistics
        self.activation_peak_bytes = run.peak_activation_bytes
        if self._cp is not None and self._cp.unchecked:  # the model's own code ran: attention?
            self._cp.unchecked = False
            check_found(FOUND["calls"], self.module)
        placed = self._steps.placement.after_step(self._run, training, run.timeline)
        if placed is not None:  # every rank, at the same step: measured W placement
            self._steps.schedules[False] = self._lowered(placed)
        return run

    def _replica_buffers(self) -> ReplicaBuffers:
        """The batch-norm statistics of this rank's stages (found once per partition)."""
        assert self.stages is not None
        steps = self._steps
        if steps.buffers is None or steps.buffers[0] is not self.stages:
            found = ReplicaBuffers(self.module, self.stages.modules, self.stages.qualnames)
            steps.buffers = (self.stages, found)
        return steps.buffers[1]

    # -- calls inside a step ---------------------------------------------------------

    def capture(self, fn: StepFunction, batches: Microbatches, j: int) -> tuple[Args, Kwargs]:
        """Run the step function for microbatch ``j`` until it calls the model."""
        self._capture = _Capture(active=True)
        try:
            with using(batches.context(j)):
                fn(self, *batches.args[j], **batches.kwargs[j])
        except Captured:
            assert self._capture.inputs is not None
            return self._capture.inputs
        finally:
            self._capture = _Capture()
        raise StepError(
            f"step function {getattr(fn, '__name__', fn)!r} returned without calling the model"
        )

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self._cp is not None:
            kwargs = prepare_call(self._cp.calls, args, kwargs, current())
        if self._capture.active:
            self._capture.inputs = (args, kwargs)
            raise Captured
        if self.active_run is None:
            raise StepError(
                "mpar.DistributedModel can only be called inside a function decorated with "
                "@mpar.step (it runs once per microbatch there)"
            )
        return self.active_run.model_forward(args, kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` through the pipeline (use instead of ``loss.backward()``)."""
        if self.active_run is None:
            raise StepError(
                "model.backward(loss) can only be called inside a function decorated with "
                "@mpar.step"
            )
        self.active_run.record_loss(loss)

    # -- nn.Module-like surface ------------------------------------------------------

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> DistributedModel:
        self.module.train(mode)
        if self.stages is not None:
            for stage in self.stages.modules.values():
                stage.train(mode)
        return self

    def eval(self) -> DistributedModel:
        return self.train(False)

    def local_parameters(self) -> list[nn.Parameter]:
        """Parameters this rank holds (all of them before partitioning)."""
        if self.stages is None:
            return list(self.module.parameters())
        seen: dict[int, nn.Parameter] = {}
        for s in sorted(self.stages.modules):
            for p in self.stages.modules[s].parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's parameters (the whole module's before partitioning)."""
        return iter(self.local_parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(original name, parameter)`` for this rank's parameters."""
        local = {id(p) for p in self.local_parameters()}
        for name, p in self.module.named_parameters():
            if id(p) in local:
                yield name, p

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, under the original module's keys."""
        if self.stages is None:
            return self.module.state_dict()
        return {key: tensor.detach() for key, tensor in self.local_tensors().items()}

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers themselves (not detached: the parameter
        objects, views of ZeRO buffers), under the original keys and their aliases; the
        whole module's before partitioning."""
        if self.stages is None:
            return dict(self.module.state_dict(keep_vars=True))
        wanted = set(self.state_keys.order)
        out: dict[str, torch.Tensor] = {}
        for s, stage in self.stages.modules.items():
            tensors = dict(stage.named_parameters()) | dict(stage.named_buffers())
            for local, original in self.stages.qualnames[s].items():
                if original in wanted and local in tensors:
                    out[original] = tensors[local]
        for key in list(out):
            for alias in self.state_keys.aliases.get(key, ()):
                out.setdefault(alias, out[key])
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered from every stage, with the original keys.

        Every rank of a pipeline gets the same dict (tensors on the CPU); it
        loads into the unwrapped module with ``module.load_state_dict``.
        """
        if self.stages is None:
            return self.module.state_dict()
        with gathered(self.sharded, self.stages):
            local = {k: v.to("cpu", copy=True) for k, v in self.local_state_dict().items()}
        if self._mixed_precision():
            assert self.sharded is not None
            masters = self.sharded.full_values()  # the optimizer's fp32 copies
            for key, pid in self._param_ids().items():
                if pid in masters:
                    local[key] = masters[pid].to("cpu", copy=True)
            local = {k: v.to(self.state_keys.dtypes[k]) for k, v in local.items()}
        local = self._ep_gathered(self._tp_gathered(local))
        merged: dict[str, torch.Tensor] = {}
        for part in all_gather_object_pp(local, self.grid):
            merged.update(part)
        missing = [k for k in self.state_keys.order if k not in merged]
        if missing:
            raise StepError(f"state_dict could not gather {missing[:5]} from any stage")
        return {k: merged[k] for k in self.state_keys.order}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a full state dict (original keys); each rank copies its own part."""
        if self.stages is None:
            self.module.load_state_dict(state_dict, strict=strict)
            return
        if strict:
            order = self.state_keys.order
            missing = [k for k in order if k not in state_dict]
            unexpected = [k for k in state_dict if k not in set(order)]
            if missing or unexpected:
                raise KeyError(
                    f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
                )
        state_dict = self._pieces_of(state_dict)
        with torch.no_grad(), gathered(self.sharded, self.stages, write_back=True):
            for key, tensor in self.local_state_dict().items():
                if key in state_dict:
                    tensor.copy_(state_dict[key])
        if self._mixed_precision():  # master copies keep the values' full precision
            assert self.sharded is not None
            ids = self._param_ids()
            self.sharded.load_values({ids[k]: v for k, v in state_dict.items() if k in ids})

    def tp_shard_of(self, key: str) -> TPShard | None:
        """How tensor parallelism splits the tensor under ``key`` (None: kept whole)."""
        if self.tp_layout is None:
            return None
        for name in self.state_keys.names_of(key):
            if name in self.tp_layout.shards:
                return self.tp_layout.shards[name]
        return None

    def split_of(self, key: str) -> tuple[TPShard, int] | None:
        """How the tensor under ``key`` is split over ranks and which piece this rank
        holds: by tensor parallelism (its TP rank's) or, a fused expert weight, by expert
        parallelism (its ep rank's); None: this rank holds it whole."""
        shard = self.tp_shard_of(key)
        if shard is not None:
            return shard, self.grid.tp_rank
        if self.ep_layout is not None:
            for name in self.state_keys.names_of(key):
                if name in self.ep_layout.shards:
                    return self.ep_layout.shards[name], self.grid.ep_rank
        return None

    def _cuts(self) -> dict[int, Callable[[torch.Tensor], torch.Tensor]]:
        """id(parameter) -> cut of this rank's piece (TP, or expert rows) from its whole
        value."""
        cuts: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        for name, p in self.module.named_parameters():
            split = self.split_of(name)
            if split is not None:
                cuts[id(p)] = functools.partial(split[0].local, rank=split[1])
        return cuts

    def _tp_gathered(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``local`` with every TP-split tensor assembled from the TP group's pieces."""
        split = {k: v for k, v in local.items() if self.tp_shard_of(k) is not None}
        if not split:
            return local
        parts = all_gather_object_tp(split, self.grid)
        out = dict(local)
        for key in split:
            shard = self.tp_shard_of(key)
            assert shard is not None
            out[key] = shard.assemble([part[key] for part in parts])
        return out

    def _ep_gathered(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``local`` with every fused expert weight assembled from the ep group's rows,
        and the experts other ranks of the ep group hold added."""
        layout = self.ep_layout
        if layout is None:
            return local
        split = {k: v for k, v in local.items() if k in layout.shards}
        placed = {k: v for k, v in local.items() if k in layout.placed}
        parts = all_gather_object_ep((split, placed), self.grid)
        out = dict(local)
        for key in split:
            out[key] = layout.shards[key].assemble([part[0][key] for part in parts])
        for part in parts:
            out.update(part[1])
        return out

    def _pieces_of(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``state`` (whole tensors) with every split tensor cut to this rank's piece."""
        if self.tp_layout is None and self.ep_layout is None:
            return state
        out = dict(state)
        for key, value in state.items():
            split = self.split_of(key)
            if split is not None:
                out[key] = split[0].local(value, split[1])
        return out

    def _mixed_precision(self) -> bool:
        return self.sharded is not None and self.sharded.compute_dtype is not None

    def _param_ids(self) -> dict[str, int]:
        """Original key (aliases included) -> ``id`` of this rank's parameter under it."""
        return {
            key: id(tensor)
            for key, tensor in self.local_tensors().items()
            if isinstance(tensor, nn.Parameter)
        }

    def param_names(self) -> dict[int, str]:
        """``id(parameter) -> name``: the first state-dict key of each parameter (of the
        original module, as wrapped: other ranks' experts included, and of this rank's
        stages)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        for ident, name in self.adapted.wrapped_names.items():
            names.setdefault(ident, name)
        if self.stages is not None:
            for key, tensor in self.local_tensors().items():
                if isinstance(tensor, nn.Parameter):
                    names.setdefault(id(tensor), key)
        return names


def _check_gradients_cleared(sharded: ShardedStages | None) -> None:
    """fp16: a training step after ``optimizer.step()`` without ``zero_grad()`` would add
    loss-scaled gradients to the unscaled ones the step left (``LossScaler.kept_past_step``)."""
    scaler = None if sharded is None else sharded.scaler
    if scaler is not None and scaler.kept_past_step:
        raise StepError(
            "fp16: a training step after optimizer.step() without optimizer.zero_grad(): "
            "the gradients that step read are unscaled, this step's are multiplied by the "
            "loss scale, and their sum would be neither. Call optimizer.zero_grad() after "
            "each optimizer.step() (to accumulate gradients, run several steps before one "
            "optimizer.step())"
        )


def _refuse_released_calls(model: DistributedModel) -> None:
    """After partitioning, a call of ``model.module`` itself outside a step (Hugging Face's
    ``generate``, a plain forward to evaluate) raises a :class:`StepError` that says what
    to do where this rank released some of the module's parameters (other ranks' pipeline
    stages, ZeRO-3 shards): torch's own error ("'weight' must be 2-D") names none of it."""
    owner = weakref.ref(model)
    shapes = model.state_keys.named_shapes

    def check(module: nn.Module, args: object) -> None:
        wrapper = owner()
        if wrapper is None or wrapper.active_run is not None:
            return  # a step runs the module (pp 1): its units are gathered as needed
        released = [
            name
            for name, p in module.named_parameters()
            if p.numel() == 0 and shapes.get(name, p.shape).numel() > 0
        ]
        if released:
            raise StepError(
                f"{type(module).__name__} was called outside a step, but this rank released "
                f"{len(released)} of its parameters (e.g. {released[0]!r}: other pipeline "
                "ranks' stages, or ZeRO-3 shards) when mpar partitioned it. Run inference "
                "through the DistributedModel in a @mpar.step function without "
                "model.backward (under torch.no_grad(); a generation loop calls it once per "
                "token, see docs/runtime.md, 'Inference and generation'), or load "
                "model.state_dict() into a fresh copy of the module"
            )

    model.module.register_forward_pre_hook(check)


def _tp_layout(module: nn.Module, grid: ProcessGrid, config: Config) -> TPLayout | None:
    """The checked tensor-parallel layout of ``module`` (raises before any step when the
    plan cannot apply), or None without tensor parallelism; with sequence parallelism
    where ``sequence_parallel_on``."""
    if grid.tp_size == 1:
        return None
    from mpar.tensor_parallel import plan_layout, resolve_plan, sequence_parallel_on

    plan, source = resolve_plan(module, config.tp_plan)
    sequence = sequence_parallel_on(plan, config.optimize)
    return plan_layout(module, plan, grid.tp_size, source, sequence_parallel=sequence)


def _ep_layout(
    module: nn.Module, grid: ProcessGrid, config: Config, tp: TPLayout | None
) -> EPLayout | None:
    """The checked expert-parallel layout of ``module`` (raises before any step when its
    experts cannot split over the ep degree), or None at expert_parallel_degree 1."""
    if grid.ep_size == 1:
        return None
    from mpar.expert_parallel import EPPlanError, plan_ep_layout

    if tp is not None and tp.sequence is not None:
        raise EPPlanError(
            f"expert_parallel_degree {grid.ep_size} with sequence parallelism (optimize "
            f"'memory' at tensor_parallel_degree {grid.tp_size}, or a 'sequence_parallel' "
            "tp_plan entry) is not supported: the TP ranks would route different tokens "
            "through experts they hold alike; use optimize 'speed', or expert_parallel_degree 1"
        )
    return plan_ep_layout(module, grid.ep_size, config.ep_plan)


class _ManualPlan:
    """Description of a partition that was placed by hand (``auto_partition: false``)."""

    def __init__(self, stages: LocalStages) -> None:
        self.units = stages.unit_names

    def __str__(self) -> str:
        rows = [f"stage {s}: {', '.join(names)}" for s, names in enumerate(self.units)]
        return "manual partition\n" + "\n".join(rows)
