"""Executing one rank's share of a pipeline schedule for one step.

A :class:`StepRun` walks this rank's list of the lowered schedule
(``mpar.schedule.executable_schedule``: the object ``mpar schedule`` prints and
simulates) in order, one handler per action kind:

* ``F(s, j)``: take stage ``s``'s input for microbatch ``j`` (the captured model
  inputs for stage 0, otherwise what ``RECV_F`` received or, when stage
  ``s - 1`` is on this rank, what its forward left here), run the stage, and
  leave its outputs for stage ``s + 1`` (for ``SEND_F`` when that stage is on
  another rank). The last stage runs inside the user's step function:
  ``model(...)`` there returns the model's output and ``model.backward(loss)``
  records the loss.
* ``B(s, j)``: backpropagate the recorded loss (last stage, scaled by the
  microbatch's share of the batch) or the output gradients from stage
  ``s + 1``, leaving the input gradients for stage ``s - 1`` (``SEND_B``). A
  microbatch whose step never called ``model.backward`` sends "no gradient"
  markers instead, so forward-only steps need no special schedule.
* ``I(s, j)`` / ``W(s, j)``: the two halves of ``B`` (``runtime._split_backward``).
* ``SEND_F`` / ``SEND_B``: start sending what the F / B (or I) before left;
  ``RECV_F`` / ``RECV_B``: wait for a transfer and keep it for the F / B after.
* ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``: the :class:`Sharding` methods
  (``mpar.shard.ShardedStages`` satisfies it).

The handlers sit in a table keyed by :class:`~mpar.schedule.Kind`; each takes the
action's stage and microbatch.

Sends never block; receives do, in list order — the semantics that
``mpar.schedule.simulate`` checks for deadlock. Each receive is posted earlier, before
the action :func:`mpar.schedule.receive_posts` names, in an order that holds under
NCCL's point-to-point rules on every backend; step outputs come back by collectives
at the end of the step (``runtime._transfers``). When stage ``s``
finishes its last backward, its gradients start their data-parallel reduction
while the rest of the schedule runs. What the stages keep for backward is
counted by ``runtime._activations``.

The run knows the model only through what it is given (stages, sharding, and
two callables for the user's step function); the model reaches the run through
``model.active_run`` while a step is under way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from mpar import _device
from mpar._cp_context import using
from mpar._tree import tree_leaves, tree_map
from mpar.comm import State
from mpar.comm._progress import PROGRESS
from mpar.comm._types import Transfer, TransferLabel
from mpar.errors import StepError
from mpar.runtime._activations import ActivationMemory, storage_bytes
from mpar.runtime._cp_outputs import combine_over_cp
from mpar.runtime._microbatch import Microbatches
from mpar.runtime._output import StepOutput, check_gatherable, detach, detach_to_cpu
from mpar.runtime._precision import cast_floats, compute_dtype
from mpar.runtime._recompute import run_stage
from mpar.runtime._split_backward import defer_weight_gradients, split_backward
from mpar.runtime._timeline import StepTimeline
from mpar.runtime._transfers import Transfers
from mpar.schedule import COMPUTE_KINDS, Action, Kind, Schedule

if TYPE_CHECKING:
    from mpar.runtime._local_stages import LocalStages

__all__ = [
    "NO_SHARDING",
    "Captured",
    "NoSharding",
    "PendingBackward",
    "PerMicrobatch",
    "Sharding",
    "StepCalls",
    "StepRun",
]

Args = tuple[object, ...]
Kwargs = dict[str, object]
_T = TypeVar("_T")
Handler = Callable[[int, int], None]
"""An action kind's handler: ``handler(stage, microbatch)`` (-1 for stage-wide kinds)."""


class Sharding(Protocol):
    """What a step needs from ZeRO sharding: ``mpar.shard.ShardedStages``, or
    :data:`NO_SHARDING` where nothing is sharded or reduced."""

    @property
    def loss_scale(self) -> float:
        """What each loss is multiplied by before backward (fp16 loss scaling)."""
        ...

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat parameter buffers the stages' parameters are views into now."""
        ...

    def reset_peak(self) -> None: ...
    def start_unshard(self, s: int, *, backward: bool = False) -> None: ...
    def wait_unsharded(self, s: int) -> None: ...
    def reshard(self, s: int) -> None: ...
    def after_forward(self, s: int) -> None: ...
    def bind_grads(self, s: int) -> None: ...
    def reduce_grads_in_backward(self, s: int) -> None: ...
    def after_backward(self, s: int) -> None: ...
    def fold_grads(self) -> None: ...
    def reduce_grads(self, s: int) -> None: ...
    def finish_grads(self) -> None: ...


class NoSharding:
    """:class:`Sharding` without sharding: every call is a no-op (the schedule of a
    model without ZeRO, data parallelism or mixed precision has no ZeRO actions)."""

    loss_scale = 1.0

    def flat_buffers(self) -> list[torch.Tensor]:
        return []

    def reset_peak(self) -> None:
        pass

    def start_unshard(self, s: int, *, backward: bool = False) -> None:
        pass

    def wait_unsharded(self, s: int) -> None:
        pass

    def reshard(self, s: int) -> None:
        pass

    def after_forward(self, s: int) -> None:
        pass

    def bind_grads(self, s: int) -> None:
        pass

    def reduce_grads_in_backward(self, s: int) -> None:
        pass

    def after_backward(self, s: int) -> None:
        pass

    def fold_grads(self) -> None:
        pass

    def reduce_grads(self, s: int) -> None:
        pass

    def finish_grads(self) -> None:
        pass


NO_SHARDING = NoSharding()


class Captured(BaseException):
    """Raised by ``model(...)`` while only the model's inputs are being captured."""


def _as_inputs(value: Args) -> Args:
    """Fresh graph leaves for a stage's inputs, keeping ``requires_grad``."""
    return tree_map(lambda t: t.detach().requires_grad_(t.requires_grad), value)


def _nothing() -> None:
    pass


def _gradient_pairs(
    outputs: object, out_grads: object
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """(outputs, their received gradients) for the outputs that take part in autograd."""
    pairs = [
        (o, g)
        for o, g in zip(tree_leaves(outputs), tree_leaves(out_grads))
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _input_grads(inputs: object) -> object:
    if isinstance(inputs, torch.Tensor):
        return inputs.grad if inputs.requires_grad else None
    if isinstance(inputs, tuple | list):
        return type(inputs)(_input_grads(v) for v in inputs)
    if isinstance(inputs, dict):
        return type(inputs)((k, _input_grads(v)) for k, v in inputs.items())
    return None


def _unshard_phases(actions: Sequence[Action]) -> dict[int, list[bool]]:
    """Per stage, for each of its UNSHARD actions in order: whether the stage's next
    computation after it is a backward."""
    out: dict[int, list[bool]] = {}
    for i, action in enumerate(actions):
        if action.kind is not Kind.UNSHARD:
            continue
        following = (
            a.kind for a in actions[i + 1 :] if a.stage == action.stage and a.kind in COMPUTE_KINDS
        )
        out.setdefault(action.stage, []).append(next(following, Kind.F) is not Kind.F)
    return out


@dataclass(frozen=True)
class StepCalls:
    """The user's step function as a run calls it: ``call(j)`` runs it on microbatch
    ``j`` (it calls ``model(...)``, which comes back to the run as
    :meth:`StepRun.model_forward`); ``capture(j)`` runs it only up to ``model(...)`` and
    returns that call's ``(args, kwargs)``; ``name`` names it in errors."""

    call: Callable[[int], object]
    capture: Callable[[int], tuple[Args, Kwargs]]
    name: str = "step"


@dataclass
class PerMicrobatch:
    """What a run keeps per microbatch ``j`` between the actions that use it."""

    inputs: dict[int, tuple[Args, Kwargs]] = field(default_factory=dict)
    """Stage 0's captured ``(args, kwargs)``, until its F."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """The loss ``model.backward(loss)`` recorded, until the last stage's backward."""
    results: dict[int, object] = field(default_factory=dict)
    """What the step function returned (detached, on the device until the last one)."""
    labelled: set[int] = field(default_factory=set)
    """Microbatches whose model call got ``labels``: their loss is the model's own,
    over the targets it keeps (``Microbatches.targets``' column 1)."""


@dataclass
class PendingBackward:
    """A run's backward bookkeeping, per stage ``s`` and microbatch ``j``."""

    saved: dict[tuple[int, int], tuple[Args, object]] = field(default_factory=dict)
    """(s, j) -> its inputs and outputs, kept for its backward."""
    weight_work: dict[tuple[int, int], Callable[[], None]] = field(default_factory=dict)
    """(s, j) -> the W still to run after its I."""
    done: dict[int, int] = field(default_factory=dict)
    """s -> microbatches whose weight gradients are done (B or W)."""
    bound: set[int] = field(default_factory=set)
    """Stages whose gradients autograd accumulates into the sharding's flat buffers."""


@dataclass
class _Call:
    """The step function running now (on the last stage's rank), for microbatch ``j``."""

    j: int
    model_called: bool = False


class StepRun:
    """One step of one rank: the run loop over its schedule actions, and their computations.

    Its transfers are a :class:`~mpar.runtime._transfers.Transfers`, its activation
    accounting an :class:`~mpar.runtime._activations.ActivationMemory`.
    """

    def __init__(
        self,
        stages: LocalStages,
        sharded: Sharding | None,
        schedule: Schedule,
        batches: Microbatches,
        st: State,
        fn: StepCalls,
        *,
        record: bool = False,
        signature: Hashable = None,
    ) -> None:
        """``fn``: the user's step function; ``sharded`` None: nothing is sharded (the
        schedule has no ZeRO actions); ``record``: keep a timeline even without
        ``trace``; ``signature``: what the shapes of the step's transfers follow from
        (``runtime._transfers.step_signature``)."""
        if len(batches) != schedule.num_microbatches:
            raise StepError(
                f"internal: the batch was split into {len(batches)} microbatches but the "
                f"schedule runs {schedule.num_microbatches}"
            )
        self.stages, self.batches, self.st, self.fn = stages, batches, st, fn
        self.sharding: Sharding = NO_SHARDING if sharded is None else sharded
        self.schedule = schedule
        """The lowered schedule; the run's one microbatch count is its ``num_microbatches``."""
        self.per_microbatch = PerMicrobatch()
        self.pending = PendingBackward()
        self.outputs: StepOutput | None = None
        """Every replica's step outputs, once :meth:`run` is done."""
        self.calling: _Call | None = None
        """The step function running now, if any."""
        recording = st.config.trace or record
        self.synchronized = record
        """Timed for a placement: each action waits for its device work (nothing to wait
        for on the CPU), so its time is the device's; a traced run is timed as it runs."""
        self.timeline: StepTimeline | None = StepTimeline(time.time()) if recording else None
        """With ``trace`` (or ``record``): each action's start and end (``runtime._timeline``)."""
        self.transfers = Transfers(schedule, st, self.timeline, signature)
        params = (p for m in stages.modules.values() for p in m.parameters())
        self.memory = ActivationMemory(chain(params, self.sharding.flat_buffers()))
        self.unshard_for_backward = _unshard_phases(self.actions)
        if self.training and st.config.split_backward:  # I/W: linear layers keep their W for later
            # not stage 0: no stage waits for its input gradients, so its I and W may as
            # well be one ordinary backward (in W), without the deferring layers' cost
            # (nor a stage some of whose backwards are whole: a B would accumulate the
            # deferred gradients outside autograd, after ZeRO's backward hooks)
            kinds = {(a.kind, a.stage) for a in self.actions}
            for s in {s for k, s in kinds if k is Kind.I} - {s for k, s in kinds if k is Kind.B}:
                if s != 0:
                    defer_weight_gradients(stages.modules[s])

    @property
    def actions(self) -> list[Action]:
        """This rank's actions, in order."""
        return self.schedule.actions.get(self.st.grid.pp_rank, [])

    @property
    def training(self) -> bool:
        """Whether the step computes gradients (its schedule has backward actions)."""
        return not self.schedule.is_forward_only

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def dtype(self) -> torch.dtype | None:
        """Mixed precision: stage 0 casts float inputs to it, the last stage casts back."""
        return compute_dtype(self.st.config)

    @property
    def peak_activation_bytes(self) -> int:
        """Peak of the bytes kept for backward during the step."""
        return self.memory.peak_bytes

    # -- the user's step function ------------------------------------------------

    def capture_inputs(self) -> None:
        """Run the step function up to ``model(...)`` to learn stage 0's inputs."""
        for j in range(self.num_microbatches):
            self.per_microbatch.inputs[j] = self.fn.capture(j)

    def model_forward(self, args: Args, kwargs: Kwargs) -> object:
        """``model(...)`` inside the step function, on the rank of the last stage."""
        call = self.calling
        if call is None:
            raise StepError("internal: the model was called outside a microbatch's step function")
        if call.model_called:
            raise StepError(
                "the model was called twice for one microbatch; mpar pipelines one forward "
                "pass per microbatch: call model(...) once in the step function"
            )
        call.model_called = True
        if kwargs.get("num_items_in_batch") is not None:
            raise StepError(
                "the model was called with num_items_in_batch: mpar weighs each microbatch's "
                "loss by its share of the batch's kept targets itself (labels other than "
                "-100, docs/runtime.md); drop num_items_in_batch from the model call"
            )
        if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
            self.per_microbatch.labelled.add(call.j)  # its loss: the model's own
        entered = time.perf_counter()
        try:
            return self._model_forward(call.j, args, kwargs)
        finally:
            if self.timeline is not None:  # the step function's time counts as computed:
                self.timeline.computed -= time.perf_counter() - entered  # not this call's

    def _model_forward(self, j: int, args: Args, kwargs: Kwargs) -> object:
        s = self.num_stages - 1
        if s == 0:
            stage_args, stage_kwargs = cast_floats((args, kwargs), self.dtype)
        else:
            stage_args, stage_kwargs = self._stage_input(s, j), {}
        output = self._run(s, j, stage_args, stage_kwargs)
        if self.dtype is not None:
            output = cast_floats(output, torch.float32)  # the loss is computed in float32
        if self.training:
            self.pending.saved[(s, j)] = (stage_args, None)
            self.memory.hold(stage_args)
        return output

    def record_loss(self, loss: torch.Tensor) -> None:
        """``model.backward(loss)`` inside the step function."""
        if not self.training:
            raise StepError(
                "model.backward(loss) was called in a step run without gradients "
                "(under torch.no_grad()); remove the no_grad context to train"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise StepError(
                "model.backward(loss) needs a scalar tensor that requires grad "
                f"(got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)})" if isinstance(loss, torch.Tensor) else ")")
            )
        if self.calling is None:
            raise StepError("internal: model.backward(loss) outside a microbatch's step function")
        losses = self.per_microbatch.losses
        if self.calling.j in losses:
            raise StepError("model.backward(loss) was called twice for one microbatch")
        losses[self.calling.j] = loss

    # -- computations --------------------------------------------------------------

    def _stage_input(self, s: int, j: int) -> Args:
        payload = self.transfers.take(TransferLabel(Transfer.ACTIVATIONS, s, j))
        if not isinstance(payload, tuple):  # forward() leaves a tuple
            raise StepError(f"internal: stage {s} received {type(payload).__name__}, not a tuple")
        return tuple(_as_inputs(payload) if self.training else payload)

    def _computing(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)``, the stage's own computation: with ``trace``, its time counts
        as computed, not as the runtime's overhead (``runtime._timeline``)."""
        timeline = self.timeline
        if timeline is None:
            return fn(*args)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            timeline.computed += time.perf_counter() - start

    def _run(self, s: int, j: int, args: Args, kwargs: Kwargs) -> object:
        self.sharding.wait_unsharded(s)  # a prefetched gather must land first
        stage = self.stages.modules[s]
        config, device = self.st.config, self.st.device
        try:
            with using(self.batches.context(j)):  # context parallelism: j's sequence split
                if self.training and torch.is_grad_enabled():
                    with self.memory.counting(stage, s, j, (args, tuple(kwargs), kwargs)):
                        return self._computing(run_stage, stage, args, kwargs, config, device)
                return self._computing(run_stage, stage, args, kwargs, config, device)
        finally:
            self.sharding.after_forward(s)

    def forward(self, s: int, j: int) -> None:
        """F: stage ``s`` for microbatch ``j`` (the last stage inside the step function)."""
        if s == self.num_stages - 1:
            self._last_stage_forward(j)
            return
        if s == 0:
            args, kwargs = cast_floats(self.per_microbatch.inputs.pop(j), self.dtype)
        else:
            args, kwargs = self._stage_input(s, j), {}
        output = self._run(s, j, args, kwargs)
        _device.after_action(self.st.device)
        if not isinstance(output, tuple):
            output = (output,)
        if self.training:
            self.pending.saved[(s, j)] = (args, output)
            self.memory.hold((args, output))
        self.transfers.leave(TransferLabel(Transfer.ACTIVATIONS, s + 1, j), output)

    def _last_stage_forward(self, j: int) -> None:
        self.calling = call = _Call(j)
        try:
            with using(self.batches.context(j)):
                result = self._computing(self.fn.call, j)
        finally:
            self.calling = None
        _device.after_action(self.st.device)
        if not call.model_called:
            raise StepError(f"step function {self.fn.name!r} never called the model")
        check_gatherable(result)
        results = self.per_microbatch.results
        results[j] = detach(result)  # stays on the device until the step's last
        if len(results) == self.num_microbatches:
            mine = [results[j] for j in range(self.num_microbatches)]
            targets = self._output_targets()
            if self.st.grid.world_size > 1:  # gathered now; one rank's wait to be read
                mine, targets = detach_to_cpu((mine, targets))
            if self.batches.contexts is not None:  # the CP group's pieces, put together
                mine = combine_over_cp(mine, self.batches.contexts, self.st.grid)
            self.transfers.send_outputs((mine, list(self.batches.sizes), targets))

    def _output_targets(self) -> torch.Tensor | None:
        """Each microbatch's kept targets, for ``StepOutput.reduce_mean`` (those of the
        model's own loss where it was called with ``labels``); None where not counted."""
        targets = self.batches.targets
        if targets is None:
            return None
        labelled = self.per_microbatch.labelled
        return torch.stack([targets[j, int(j in labelled)] for j in range(len(targets))])

    def _prepare_backward(self, s: int, *, arm: bool) -> None:
        sharding = self.sharding
        sharding.wait_unsharded(s)
        pending = self.pending
        if s not in pending.bound:
            sharding.bind_grads(s)  # autograd accumulates into the flat buffers
            pending.bound.add(s)
        if arm and pending.done.get(s, 0) == self.num_microbatches - 1:
            sharding.reduce_grads_in_backward(s)  # overlap reduction with the last B

    def backward(self, s: int, j: int) -> None:
        """B: input and weight gradients of stage ``s`` for microbatch ``j``."""
        self._prepare_backward(s, arm=True)
        self._backward_input(s, j, split=False)
        self._weights_done(s)

    def backward_input(self, s: int, j: int) -> None:
        """I: only the gradient of the stage's input (what the previous stage waits for);
        what the weight gradients need is kept for the W of the same microbatch."""
        self._prepare_backward(s, arm=False)
        self._backward_input(s, j, split=True)

    def backward_weight(self, s: int, j: int) -> None:
        """W: the weight gradients of stage ``s`` for microbatch ``j``, after its I."""
        self._prepare_backward(s, arm=False)
        work = self.pending.weight_work.pop((s, j), None)
        if work is None:
            raise StepError(f"internal: {s}W{j} runs before {s}I{j}")
        with using(self.batches.context(j)):
            self._computing(work)
        self.sharding.fold_grads()  # fp32 gradients: add what W wrote outside autograd
        self.memory.weights_done(s, j)
        _device.after_action(self.st.device)
        self._weights_done(s)

    def _weights_done(self, s: int) -> None:
        done = self.pending.done
        done[s] = done.get(s, 0) + 1

    def _roots(
        self, s: int, j: int, outputs: object
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What stage ``s``'s backward for ``j`` starts from: the scaled loss (last stage)
        or its outputs with their received gradients; none when there is no gradient."""
        if s == self.num_stages - 1:
            loss = self.per_microbatch.losses.pop(j, None)
            if loss is None:
                return [], None
            context = self.batches.context(j)  # a CP rank's share of the sequence's loss
            share = 1.0 if context is None else context.loss_weight
            own = j in self.per_microbatch.labelled
            weight = self.batches.loss_weight(j, self.st.grid.dp_size, own=own)
            scaled = loss * (weight * share)
            loss_scale = self.sharding.loss_scale
            if loss_scale != 1.0:  # fp16: dynamic loss scaling
                scaled = scaled * loss_scale
            return [scaled], None
        out_grads = self.transfers.take(TransferLabel(Transfer.GRADIENTS, s, j))
        return ([], None) if out_grads is None else _gradient_pairs(outputs, out_grads)

    def _backward_input(self, s: int, j: int, *, split: bool) -> None:
        with using(self.batches.context(j)):  # a recomputed forward needs j's split
            self._backward_input_of(s, j, split=split)

    def _backward_input_of(self, s: int, j: int, *, split: bool) -> None:
        inputs, outputs = self.pending.saved.pop((s, j))
        dropped = self.memory.drop(s, j, (inputs, outputs))
        roots, root_grads = self._roots(s, j, outputs)
        grads: object = None
        work: Callable[[], None] = _nothing
        if roots:
            if split:
                keep = self.st.config.split_backward
                work = self._computing(
                    lambda: split_backward(roots, root_grads, inputs, split=keep)
                )
                # what W still needs stays among the step's activations until it runs
                if work.whole is None:
                    dropped = self.memory.held_for_weights(
                        s, j, lambda: storage_bytes(work.held_tensors(), self.memory.excluded)
                    )
                self.memory.hold_for_weights(s, j, dropped)
            else:
                try:
                    self._computing(torch.autograd.backward, roots, root_grads)
                finally:
                    self.sharding.after_backward(s)
            grads = _input_grads(inputs)
        if split:
            self.pending.weight_work[(s, j)] = work
        _device.after_action(self.st.device)
        if s > 0:
            self.transfers.leave(TransferLabel(Transfer.GRADIENTS, s - 1, j), grads)

    # -- communication and ZeRO actions ---------------------------------------------

    def _recv_f(self, s: int, j: int) -> None:
        self.transfers.receive(TransferLabel(Transfer.ACTIVATIONS, s, j))

    def _recv_b(self, s: int, j: int) -> None:
        self.transfers.receive(TransferLabel(Transfer.GRADIENTS, s, j))

    def _send_f(self, s: int, j: int) -> None:
        self.transfers.send(TransferLabel(Transfer.ACTIVATIONS, s + 1, j))

    def _send_b(self, s: int, j: int) -> None:
        self.transfers.send(TransferLabel(Transfer.GRADIENTS, s - 1, j))

    def _unshard(self, s: int, _: int) -> None:
        """UNSHARD: start the stage's gathers (with unit groups, the group its next
        computation starts with: the first for a forward, the last for a backward)."""
        backward = self.unshard_for_backward.get(s, [])
        self.sharding.start_unshard(s, backward=backward.pop(0) if backward else False)

    def _reshard(self, s: int, _: int) -> None:
        self.sharding.reshard(s)

    def _reduce_grad(self, s: int, _: int) -> None:
        self.sharding.reduce_grads(s)

    # -- the whole step ------------------------------------------------------------

    def _handlers(self, *, stage_wide: bool) -> dict[Kind, Handler]:
        """One handler per action kind this run executes (the ZeRO ones only when
        ``stage_wide``: the stages are sharded)."""
        handlers: dict[Kind, Handler] = {
            Kind.F: self.forward,
            Kind.B: self.backward,
            Kind.I: self.backward_input,
            Kind.W: self.backward_weight,
            Kind.SEND_F: self._send_f,
            Kind.SEND_B: self._send_b,
            Kind.RECV_F: self._recv_f,
            Kind.RECV_B: self._recv_b,
        }
        if stage_wide:
            handlers[Kind.UNSHARD] = self._unshard
            handlers[Kind.RESHARD] = self._reshard
            handlers[Kind.REDUCE_GRAD] = self._reduce_grad
        return handlers

    def run(self) -> StepOutput:
        """Execute this rank's actions; every replica's outputs (also ``self.outputs``)."""
        self.sharding.reset_peak()
        if 0 in self.stages.modules and self.num_stages > 1:
            self.capture_inputs()
        # a local table: bound methods kept on self would make a cycle that holds the
        # run (and through ``call`` the model) until the garbage collector runs
        handlers = self._handlers(stage_wide=self.sharding is not NO_SHARDING)
        timeline, transfers = self.timeline, self.transfers
        posts = transfers.posts
        for index, action in enumerate(self.actions):
            if posts[index]:  # receives this rank posts before the action
                transfers.post(posts[index])
            PROGRESS.begin(action)  # the hang watchdog's view of this rank; ~free
            handler = handlers.get(action.kind)
            if handler is None:
                raise StepError(f"the pipeline runtime cannot execute action {action}")
            j = action.microbatch
            if timeline is None:
                handler(action.stage, -1 if j is None else j)
            else:
                start, waited, computed = time.time(), timeline.waited, timeline.computed
                handler(action.stage, -1 if j is None else j)
                if self.synchronized:
                    _device.synchronize([self.st.device])
                end = time.time()
                timeline.actions.append(
                    (
                        str(action),
                        start,
                        end,
                        timeline.waited - waited,
                        timeline.computed - computed,
                    )
                )
        transfers.check_all_sent()
        self.outputs = transfers.gather_outputs()
        transfers.finish()
        if self.training:
            self.sharding.finish_grads()
        return self.outputs
