"""DistributedOptimizer: any torch optimizer, over a partitioned model.

The wrapped optimizer was built on the whole module's parameters (before the
first step partitioned it). Parameters of stages held by other ranks never get
a gradient here, so torch's optimizers skip them; this wrapper adds what needs
communication: the global gradient norm for clipping, and a gathered (full)
optimizer ``state_dict`` that loads into the same optimizer on the unwrapped
model.

The wrapper belongs to one :class:`~mpar.DistributedModel`: the one given as
``model=``, or else the one whose module holds the optimizer's parameters (found
among the models of this ``mpar.init``; parameters of two models are refused as
ambiguous).

Under fp16 mixed precision the gradients arrive multiplied by the dynamic loss
scale. Before the first of ``clip_grad_norm_`` / ``step`` in a step, every rank
learns whether any rank's gradients hold an inf or NaN (one all-reduce of a
flag); if so, ``step`` skips the update on every rank and the scale halves,
otherwise the scale is divided out first (see :class:`mpar.shard.ShardedStages`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard, cast, overload

import torch

from mpar import _device
from mpar.comm._collectives import (
    all_gather_object_pp,
    all_gather_object_tp,
    all_reduce_pp,
    all_reduce_tp,
    group_size,
    world_all_reduce,
)
from mpar.comm._lifecycle import session
from mpar.errors import StepError
from mpar.runtime._model import DistributedModel
from mpar.shard import ShardedOptimizer
from mpar.tensor_parallel import TPShard

__all__ = ["DistributedOptimizer"]

StateDict = dict[str, Any]
"""An optimizer's ``state_dict()`` (``"state"``, ``"param_groups"``), as torch types it."""
Group = dict[str, Any]
"""One of an optimizer's ``param_groups``, as torch types it."""
ParamStates = dict[int | str, dict[str, object]]
"""A state dict's ``"state"``: each parameter's (by index) named tensors and numbers."""


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _elementwise(value: object, shape: torch.Size) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is per-element state of a parameter of ``shape``."""
    return isinstance(value, torch.Tensor) and value.shape == shape


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` for a model trained with :class:`mpar.DistributedModel`.

    ``model``: the model whose parameters ``optimizer`` updates; by default the
    one whose module holds them.

    It is a ``torch.optim.Optimizer`` (its ``param_groups`` are the wrapped
    optimizer's), so learning-rate schedulers step it as they step a plain one;
    torch's own ``Optimizer.__init__`` is not run: the wrapped optimizer holds the
    groups and the state.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, model: DistributedModel | None = None
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
            optimizer, DistributedOptimizer
        ):
            raise TypeError(
                "mpar.DistributedOptimizer wraps a torch.optim.Optimizer built on "
                f"model.parameters(), got {type(optimizer).__name__}"
            )
        if model is not None and not isinstance(model, DistributedModel):
            raise TypeError(
                f"DistributedOptimizer(model=...) takes an mpar.DistributedModel, got "
                f"{type(model).__name__}"
            )
        self._session = session()
        self.optimizer = optimizer
        self._model = model if model is not None else self._find_model()
        self._sharded: ShardedOptimizer | None = None
        self._pending: StateDict | Callable[[], None] | None = None
        """A state loaded before the model was partitioned, applied right after."""
        self._finite: bool | None = None
        """fp16: whether this step's gradients are finite everywhere (None: not checked yet)."""
        self._session.optimizers.add(self)

    def _apply_pending(self) -> None:
        if self._pending is not None and self._local_ids() is not None:
            pending, self._pending = self._pending, None
            if callable(pending):  # a checkpoint load deferred to the first step
                pending()
            else:
                self._load_now(pending)

    def defer_load(self, load: Callable[[], None]) -> None:
        """Run ``load()`` (collective) once the model is partitioned: at the first
        ``step`` or ``state_dict`` call, on every rank."""
        self._pending = load

    @property
    def load_deferred(self) -> bool:
        """Whether a checkpoint load waits for the model's partition (:meth:`defer_load`)."""
        return callable(self._pending)

    @property
    def pending_state(self) -> StateDict | None:
        """A full (torch-format) state loaded before the model was partitioned, kept to
        be applied right after (None when there is none)."""
        return self._pending if isinstance(self._pending, dict) else None

    @property
    def model(self) -> DistributedModel | None:
        """The model this optimizer updates: the one given as ``model=``, else the one
        whose module holds the optimizer's parameters (None while there is none)."""
        if self._model is None:
            self._model = self._find_model()
        return self._model

    def _find_model(self) -> DistributedModel | None:
        mine = {id(p) for p in self._all_params()}
        found = [
            m
            for m in list(self._session.models)
            if isinstance(m, DistributedModel)
            and not mine.isdisjoint(id(p) for p in m.module.parameters())
        ]
        if len(found) > 1:
            raise ValueError(
                f"the optimizer's parameters belong to {len(found)} DistributedModels; "
                "say which one it updates: mpar.DistributedOptimizer(optimizer, model=model)"
            )
        return found[0] if found else None

    def sharded_optimizer(self) -> ShardedOptimizer | None:
        """The ZeRO optimizer over this rank's shards, once a sharded model is partitioned,
        with the options of the wrapped optimizer's groups (a learning rate that a
        scheduler or the user set since the last step)."""
        model = self.model
        if self._sharded is None and model is not None and model.sharded is not None:
            self._sharded = model.sharded.wrap_optimizer(self.optimizer)
        if self._sharded is not None:
            self._sharded.pull_options()
        return self._sharded

    @property  # the wrapped optimizer's groups, read and written
    def param_groups(self) -> list[Group]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[Group]) -> None:
        self.optimizer.param_groups = groups

    def _all_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _local_ids(self) -> set[int] | None:
        """ids of parameters held on this rank; None when nothing is partitioned."""
        model = self.model
        if model is None or not model.partitioned:
            return None
        return {id(p) for p in model.local_parameters()}

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update this rank's parameters (those of other stages have no gradient here)."""
        with _device.sync_debug():
            return self._step(closure)

    def _step(self, closure: Callable[[], float] | None) -> float | None:
        self._apply_pending()
        sharded = self.sharded_optimizer()
        if sharded is not None:
            if closure is not None:
                raise ValueError(
                    "optimizer closures are not supported with ZeRO sharding or mixed precision"
                )
            scaler = sharded.sharded.scaler
            if scaler is not None:
                if scaler.kept_past_step:
                    raise StepError(
                        "fp16: optimizer.step() again without optimizer.zero_grad(): the "
                        "first step unscaled the gradients (and updated the loss scale), so "
                        "a second one would apply them divided by the loss scale once more "
                        "(with fp32 gradients) or as they are (with fp16 ones). Call "
                        "optimizer.zero_grad() and run a training step first"
                    )
                finite = self._unscale(sharded)
                self._finite = None
                scaler.update(found_inf=not finite)
                scaler.kept_past_step = True  # until zero_grad
                if not finite:
                    return None  # skipped on every rank; the loss scale was lowered
            sharded.step()
            result = None
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        _device.after_optimizer_step(self._session.state.device)
        return result

    def _unscale(self, sharded: ShardedOptimizer) -> bool:
        """fp16: once per step, check every rank's gradients and divide out the loss
        scale if they are all finite; returns whether they are."""
        if self._finite is None:
            st = self._session.state
            found = sharded.nonfinite_flag().reshape(1)
            world_all_reduce(found, st.grid)
            # the one host read of an fp16 step: whether to skip it
            self._finite = _device.host_value(found[0], "fp16 overflow flag") == 0
            if self._finite:
                sharded.scale_grads(1.0 / sharded.sharded.loss_scale)
        return self._finite

    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale under fp16 (1.0 otherwise)."""
        sharded = self.sharded_optimizer()
        return 1.0 if sharded is None else float(sharded.sharded.loss_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._finite = None
        sharded = self.sharded_optimizer()
        if sharded is not None:
            sharded.zero_grad(set_to_none=set_to_none)
            if sharded.sharded.scaler is not None:
                sharded.sharded.scaler.kept_past_step = False
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def _tied_shares(self) -> dict[int, int]:
        """``id`` -> how many ranks outside this pipeline stage's data-parallel group hold
        the same gradient (copies of a tied parameter, TP ranks of a replicated one)."""
        shares: dict[int, int] = {}
        model = self.model
        if model is not None and model.stages is not None:
            for group, param in model.stages.tied_groups:
                shares[id(param)] = group_size(group)
            stages = model.stages
            if stages.tp_size > 1:
                for p in model.local_parameters():
                    if id(p) not in stages.tp_split:
                        shares[id(p)] = shares.get(id(p), 1) * stages.tp_size
        return shares

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the global norm over every stage and shard; returns that norm.

        The norm is the one ``torch.nn.utils.clip_grad_norm_`` would compute on
        the unwrapped model's whole-batch gradients.
        """
        with _device.sync_debug():
            return self._clip_grad_norm(max_norm, norm_type)

    def _clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        sharded = self.sharded_optimizer()
        if sharded is not None:
            return self._clip_sharded(sharded, max_norm, norm_type)
        local = self._local_ids()
        grads = [
            (p, p.grad)
            for p in self._all_params()
            if p.grad is not None and (local is None or id(p) in local)
        ]
        shares = self._tied_shares()
        device = grads[0][1].device if grads else torch.device("cpu")
        grid = self._session.state.grid
        if math.isinf(norm_type):
            local_value = max((g.detach().abs().max().double() for _, g in grads), default=None)
            total = torch.zeros(1, dtype=torch.float64, device=device)
            if local_value is not None:
                total[0] = local_value
            all_reduce_tp(all_reduce_pp(total, grid, op="max"), grid, op="max")
        else:
            total = torch.zeros(1, dtype=torch.float64, device=device)
            for p, g in grads:
                total += g.detach().double().norm(norm_type) ** norm_type / shares.get(id(p), 1)
            all_reduce_tp(all_reduce_pp(total, grid), grid)
            total = total ** (1.0 / norm_type)
        norm = total[0].float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, g in grads:
            g.detach().mul_(coef.to(g.dtype))
        return norm

    def _clip_sharded(
        self, sharded: ShardedOptimizer, max_norm: float, norm_type: float
    ) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError(
                f"clip_grad_norm_ with ZeRO sharding supports norm_type 2, got {norm_type}"
            )
        finite = sharded.sharded.scaler is None or self._unscale(sharded)
        total = sharded.grad_sq_norm().to(torch.float64).reshape(1)
        world_all_reduce(total, self._session.state.grid)  # each rank: a distinct shard
        norm = total[0].sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # stays on the device
        if finite:
            sharded.scale_grads(coef)
        return norm

    def local_state_dict(self) -> StateDict:
        """This rank's optimizer state (only its parameters have any)."""
        return self.optimizer.state_dict()

    def state_dict(self) -> StateDict:
        """The full optimizer state gathered from every stage, in the unwrapped
        optimizer's format (parameter indices over all of the model's parameters)."""
        if self._pending is not None:
            self._apply_pending()
            if callable(self._pending):
                raise StepError(
                    "the optimizer state loaded from a checkpoint is applied at the first "
                    "step (when the model is partitioned); call state_dict() after it"
                )
            if self._pending is not None:  # still not partitioned: the loaded state
                return self._pending
        sharded = self.sharded_optimizer()
        if sharded is not None:
            local = sharded.state_dict()  # gathered over the data-parallel group
        else:
            local = self.optimizer.state_dict()
        merged: ParamStates = {}
        own = self._tp_assembled(_to_cpu(local["state"]))
        for part in all_gather_object_pp(own, self._session.state.grid):
            merged.update(part)
        out = {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}
        if sharded is not None and sharded.sharded.scaler is not None:
            out["loss_scaler"] = sharded.sharded.scaler.state_dict()
        return out

    def _tp_split(self) -> dict[int, tuple[TPShard, torch.Size]]:
        """Optimizer index -> (how tensor parallelism splits that parameter, its whole
        shape), for this rank's split parameters."""
        model = self.model
        if model is None or model.tp_layout is None or not model.partitioned:
            return {}
        names = model.param_names()
        out = {}
        for i, p in enumerate(self._all_params()):
            name = names.get(id(p))
            shard = None if name is None else model.tp_shard_of(name)
            if name is not None and shard is not None:
                out[i] = (shard, model.state_keys.shapes[name])
        return out

    def _tp_assembled(self, state: ParamStates) -> ParamStates:
        """``state`` with the element-wise state of every TP-split parameter (Adam's
        moments, a momentum buffer) assembled from the TP group's pieces: the shapes of
        the unwrapped model's parameters."""
        split = self._tp_split()
        if not split:
            return state
        mine = {i: values for i, values in state.items() if i in split}
        parts = all_gather_object_tp(mine, self._session.state.grid)
        out = dict(state)
        for i, values in mine.items():
            shard, whole = split[i]
            out[i] = {
                k: shard.assemble([cast(torch.Tensor, part[i][k]) for part in parts])
                if _elementwise(v, shard.local_shape(whole))
                else v
                for k, v in values.items()
            }
        return out

    def _tp_pieces(self, state: ParamStates) -> ParamStates:
        """``state`` (indices as keys) with whole element-wise tensors of TP-split
        parameters cut to this rank's pieces."""
        split = self._tp_split()
        if not split:
            return state
        rank = self._session.state.grid.tp_rank
        out = dict(state)
        for key, values in state.items():
            if int(key) in split:
                shard, whole = split[int(key)]
                out[key] = {
                    k: shard.local(v, rank) if _elementwise(v, whole) else v
                    for k, v in values.items()
                }
        return out

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a full (or this rank's) optimizer state; each rank keeps its parameters' part.

        Before the model's first step (not partitioned yet) the state is kept
        and applied as soon as the partition is known."""
        if self._local_ids() is None and self.sharded_optimizer() is None:
            self._pending = state_dict
            return
        self._load_now(state_dict)

    def _load_now(self, state_dict: StateDict) -> None:
        sharded = self.sharded_optimizer()
        local = self._local_ids()
        index_of = {id(p): i for i, p in enumerate(self._all_params())}
        keep = None if local is None else {index_of[i] for i in local if i in index_of}
        states = {k: v for k, v in state_dict["state"].items() if keep is None or int(k) in keep}
        states = self._tp_pieces(states)
        trimmed = {"state": states, "param_groups": state_dict["param_groups"]}
        scaler = None if sharded is None else sharded.sharded.scaler
        if scaler is not None and "loss_scaler" in state_dict:
            scaler.load_state_dict(state_dict["loss_scaler"])
        if sharded is not None:
            sharded.load_state_dict(trimmed)
        else:
            self.optimizer.load_state_dict(trimmed)

    def add_param_group(self, group: Group) -> None:
        self.optimizer.add_param_group(group)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)
