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
* ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``: the ``ShardedStages`` methods.

Sends never block; receives do, in list order — the semantics that
``mpar.schedule.simulate`` checks for deadlock. Receives are *posted* early,
though: at the start of the step the first receive of every incoming stream,
and after each receive the next one on its stream, so the bytes arrive while
this rank computes and the RECV action's wait is short. When stage ``s``
finishes its last backward, its gradients start their data-parallel reduction
while the rest of the schedule runs. The rank of a replica's last stage sends
that replica's step outputs to every other rank as soon as its last forward is
done (point to point, posted early like the rest), so the step ends without a
collective of its own.

The run knows the model only through what it is given (stages, sharding, and
two callables for the user's step function); the model reaches the run through
``model.active_run`` while a step is under way.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpar import _device
from mpar._compat import top_saved_tensors_hooks
from mpar._tree import tree_leaves, tree_map
from mpar.comm import State
from mpar.comm._bootstrap import on_shutdown
from mpar.comm._p2p import Links, PendingSends, recv_payload, send_payload
from mpar.comm._progress import PROGRESS
from mpar.errors import StepError
from mpar.runtime._microbatch import Microbatches
from mpar.runtime._output import StepOutput, check_gatherable, detach_to_cpu
from mpar.runtime._precision import cast_floats, compute_dtype
from mpar.runtime._recompute import run_stage
from mpar.runtime._split_backward import defer_weight_gradients, split_backward
from mpar.runtime._timeline import StepTimeline

if TYPE_CHECKING:
    from mpar.runtime._stages import LocalStages
    from mpar.shard import ShardedStages

__all__ = ["Captured", "StepRun"]

_FORWARD, _BACKWARD = 0, 1
_OUTPUTS_TAG = 1 << 20
"""The stream carrying step outputs (p2p tags of stage transfers are ``2 * stage + direction``)."""
# lowered ZeRO actions -> ShardedStages method
_SHARD_ACTIONS = {"UNSHARD": "start_unshard", "RESHARD": "reshard", "REDUCE_GRAD": "reduce_grads"}


def _tag(stage: int, direction: int) -> int:
    """The p2p tag of the transfers into ``stage`` in ``direction``."""
    return 2 * stage + direction


class Captured(BaseException):
    """Raised by ``model(...)`` while only the model's inputs are being captured."""


def _as_inputs(value: Any) -> Any:
    """Fresh graph leaves for a stage's inputs, keeping ``requires_grad``."""
    return tree_map(lambda t: t.detach().requires_grad_(t.requires_grad), value)


def _tensor_bytes(value: Any) -> int:
    return sum(
        t.untyped_storage().nbytes() for t in tree_leaves(value) if isinstance(t, torch.Tensor)
    )


def _nothing() -> None:
    pass


def _parameter_storages(stages: LocalStages, sharded: ShardedStages | None) -> set[int]:
    """Storage keys of every parameter and flat parameter buffer of this rank's stages."""
    keys = {_device.storage_key(p) for m in stages.modules.values() for p in m.parameters()}
    if sharded is not None:
        keys |= {_device.storage_key(b.full) for b in sharded.buckets if b.full is not None}
    return keys


def _stage_wide(method: Callable[[int], None]) -> Callable[[Any], None]:
    """A handler for UNSHARD / RESHARD / REDUCE_GRAD: ``method(stage)``."""
    return lambda action: method(action.stage)


def _gradient_pairs(
    outputs: Any, out_grads: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """(outputs, their received gradients) for the outputs that take part in autograd."""
    pairs = [
        (o, g)
        for o, g in zip(tree_leaves(outputs), tree_leaves(out_grads))
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _input_grads(inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.grad if inputs.requires_grad else None
    if isinstance(inputs, tuple | list):
        return type(inputs)(_input_grads(v) for v in inputs)
    if isinstance(inputs, dict):
        return type(inputs)((k, _input_grads(v)) for k, v in inputs.items())
    return None


def _unshard_phases(actions: list[Any]) -> dict[int, list[bool]]:
    """Per stage, for each of its UNSHARD actions in order: whether the stage's next
    computation after it is a backward."""
    out: dict[int, list[bool]] = {}
    for i, action in enumerate(actions):
        if action.kind.value != "UNSHARD":
            continue
        following = (
            a.kind.value
            for a in actions[i + 1 :]
            if a.stage == action.stage and a.kind.value in ("F", "B", "I", "W")
        )
        out.setdefault(action.stage, []).append(next(following, "F") != "F")
    return out


def _outer_saved_tensor_hooks() -> tuple[Any, Any] | None:
    """The ``saved_tensors_hooks`` active around the stage (the user's ``save_on_cpu``,
    say), which :class:`_SavedBytes` must keep applying."""
    return top_saved_tensors_hooks()


_SAVED_BYTES: weakref.WeakKeyDictionary[nn.Module, dict[Any, int]] = weakref.WeakKeyDictionary()
"""Stage -> {input signature: bytes autograd saved inside its forward}: counted with
:class:`_SavedBytes` on the first forward of each signature, reused after (saved-tensor
hooks cost about as much as a third of a small stage's forward on the CPU)."""
on_shutdown(_SAVED_BYTES.clear)
_SIGNATURES_KEPT = 64


def _signature(value: Any) -> tuple[Any, ...]:
    """What decides a stage's saved bytes: its inputs' shapes, dtypes and grad flags,
    and any plain values among them."""
    return tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
        if isinstance(leaf, torch.Tensor)
        else leaf
        if isinstance(leaf, int | float | bool | str | None)
        else type(leaf)
        for leaf in tree_leaves(value)
    )


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages autograd saves for backward inside a stage's
    forward (parameters and gathered parameter buffers excluded); hooks already
    active outside still pack and unpack every tensor."""

    def __init__(self, excluded: set[int]) -> None:
        self.bytes = 0
        seen: set[int] = set()
        outer = _outer_saved_tensor_hooks()

        def pack(t: torch.Tensor) -> Any:
            if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
                key = _device.storage_key(t)
                if key not in seen and key not in excluded:
                    seen.add(key)
                    self.bytes += t.untyped_storage().nbytes()
            return t if outer is None else outer[0](t)

        super().__init__(pack, _identity if outer is None else outer[1])


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class StepRun:
    """One step of one rank: its schedule actions, transfers and results."""

    def __init__(
        self,
        stages: LocalStages,
        sharded: ShardedStages | None,
        schedule: Any,
        batches: Microbatches,
        st: State,
        *,
        call: Callable[[int], Any],
        capture: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]],
        name: str = "step",
    ) -> None:
        """``call(j)`` runs the user's step function on microbatch ``j`` (it calls
        ``model(...)``, which comes back here as :meth:`model_forward`);
        ``capture(j)`` runs it only up to ``model(...)`` and returns that call's
        ``(args, kwargs)``; ``name`` names the step function in errors."""
        self.stages, self.sharded, self.batches, self.st = stages, sharded, batches, st
        self.call, self.capture, self.name = call, capture, name
        self.schedule = schedule
        self.actions: list[Any] = schedule.actions.get(st.grid.pp_rank, [])
        self.training = not schedule.is_forward_only
        self.num_stages = schedule.num_stages
        self.inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.inbox: dict[tuple[int, int, int], Any] = {}
        """(stage, microbatch, direction) -> what that stage's F or B takes: received by
        a RECV action, or left by the neighbouring stage when it is on this rank."""
        self.outbox: dict[tuple[int, int, int], Any] = {}
        """(stage, microbatch, direction) -> what a SEND action still has to send there."""
        self.saved: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.results: dict[int, Any] = {}
        self.outputs: StepOutput | None = None
        """Every replica's step outputs, once :meth:`run` is done."""
        self.backward_done: dict[int, int] = {}
        """Stage -> microbatches whose weight gradients are done (B or W)."""
        self.bound: set[int] = set()
        self.weight_work: dict[tuple[int, int], Callable[[], None]] = {}
        """(stage, microbatch) -> the W still to run after its I."""
        self.timeline: StepTimeline | None = StepTimeline(time.time()) if st.config.trace else None
        """With ``trace``: each action's start and end (``runtime._timeline``)."""
        self.pending = PendingSends()
        self.links: Links = st.p2p_links
        self.wire = _device.p2p_device(st.device, st.backend)
        """Where transfers are built and received (the host when they are staged)."""
        self.incoming = self._incoming_streams()
        self.held_bytes = 0
        """Bytes now kept for backward: stage inputs and outputs, and what autograd
        saved inside the stages."""
        self.saved_inside: dict[tuple[int, int], int] = {}
        """(stage, microbatch) -> bytes autograd saved inside its forward."""
        self.current: dict[int, int] = {}
        """Stage -> the microbatch its forward is running (for ``saved_inside``)."""
        self.excluded_storages = _parameter_storages(stages, sharded)
        self.peak_activation_bytes = 0
        """Peak of ``held_bytes`` during the step."""
        self.microbatch: int | None = None
        self.model_called = False
        self.dtype = compute_dtype(st.config)
        """Mixed precision: stage 0 casts float inputs to it, the last stage casts back."""
        self.loss_scale = 1.0 if sharded is None else sharded.loss_scale
        if self.training and st.config.split_backward:  # I/W: linear layers keep their W for later
            for s in {a.stage for a in self.actions if a.kind.value == "I"}:
                defer_weight_gradients(stages.modules[s])

    # -- the user's step function ------------------------------------------------

    def capture_inputs(self) -> None:
        """Run the step function up to ``model(...)`` to learn stage 0's inputs."""
        for j in range(len(self.batches)):
            self.inputs[j] = self.capture(j)

    def model_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``model(...)`` inside the step function, on the rank of the last stage."""
        if self.model_called:
            raise StepError(
                "the model was called twice for one microbatch; mpar pipelines one forward "
                "pass per microbatch: call model(...) once in the step function"
            )
        self.model_called = True
        s, j = self.num_stages - 1, self.microbatch
        assert j is not None
        if s == 0:
            stage_args, stage_kwargs = cast_floats((args, kwargs), self.dtype)
        else:
            stage_args, stage_kwargs = self._stage_input(s, j), {}
        output = self._run(s, stage_args, stage_kwargs)
        if self.dtype is not None:
            output = cast_floats(output, torch.float32)  # the loss is computed in float32
        if self.training:
            self.saved[(s, j)] = (stage_args, None)
            self.held_bytes += _tensor_bytes(stage_args)
            self.peak_activation_bytes = max(self.peak_activation_bytes, self.held_bytes)
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
        assert self.microbatch is not None
        if self.microbatch in self.losses:
            raise StepError("model.backward(loss) was called twice for one microbatch")
        self.losses[self.microbatch] = loss

    # -- transfers ---------------------------------------------------------------

    def _rank_of(self, stage: int) -> int:
        """Global rank of this replica that holds ``stage``."""
        return self.st.grid.pp_ranks[self.schedule.stage_to_rank(stage)]

    def _incoming_streams(self) -> dict[tuple[int, int], int]:
        """How many transfers this rank receives this step on each (source, tag) stream:
        one per RECV action, and the step outputs of every other replica."""
        counts: dict[tuple[int, int], int] = {}
        for action in self.actions:
            kind = action.kind.value
            if kind in ("RECV_F", "RECV_B"):
                stream = self._recv_stream(action.stage, kind == "RECV_B")
                counts[stream] = counts.get(stream, 0) + 1
        me = self.st.layout.rank
        for src in self._output_ranks():
            if src != me:
                counts[(src, _OUTPUTS_TAG)] = 1
        return counts

    def _recv_stream(self, stage: int, backward: bool) -> tuple[int, int]:
        """(source rank, tag) of stage ``stage``'s incoming forward or backward transfers."""
        source = stage + 1 if backward else stage - 1
        if not 0 <= source < self.num_stages:
            raise StepError(f"internal: stage {stage} receives nothing in that direction")
        return self._rank_of(source), _tag(stage, _BACKWARD if backward else _FORWARD)

    def _output_ranks(self) -> list[int]:
        """Global rank of each data-parallel replica's last stage (where its outputs are)."""
        grid = self.st.grid
        last = self.schedule.stage_to_rank(self.num_stages - 1)
        return [grid.rank_of(last, d) for d in range(grid.dp_size)]

    def _post_receives(self) -> None:
        for src, tag in self.incoming:
            self.links.post(src, tag, self.wire)

    def receive(self, action: Any, backward: bool) -> None:
        """RECV_F / RECV_B: wait for stage ``s``'s input (or output gradient) for
        microbatch ``j`` and keep it for the F (or B / I) that follows."""
        s, j = action.stage, action.microbatch
        direction = _BACKWARD if backward else _FORWARD
        stream = self._recv_stream(s, backward)
        started = time.time() if self.timeline is not None else 0.0
        payload = recv_payload(*stream, (s, j, direction), self.wire, self.links)
        if self.timeline is not None:
            self.timeline.waited += time.time() - started
        self.incoming[stream] -= 1
        if self.incoming[stream] > 0:
            self.links.post(*stream, self.wire)
        self.inbox[(s, j, direction)] = _device.to_device(payload, self.st.device)

    def send(self, action: Any, backward: bool) -> None:
        """SEND_F / SEND_B: start sending what stage ``s``'s F (or B / I) of microbatch
        ``j`` left for the next (previous) stage's rank."""
        s, j = action.stage, action.microbatch
        to_stage, direction = (s - 1, _BACKWARD) if backward else (s + 1, _FORWARD)
        label = (to_stage, j, direction)
        if label not in self.outbox:
            raise StepError(
                f"the schedule runs {action} before the {'backward' if backward else 'forward'}"
                f" of stage {s} for microbatch {j} produced what it sends"
            )
        dst, tag = self._rank_of(to_stage), _tag(to_stage, direction)
        send_payload(self.outbox.pop(label), dst, tag, label, self.pending, self.links, self.wire)

    def _leave(self, stage: int, j: int, direction: int, payload: Any) -> None:
        """What one stage computed for stage ``stage``: into its inbox when that stage
        is on this rank, else for the SEND action that follows."""
        target = self.inbox if self._rank_of(stage) == self.st.layout.rank else self.outbox
        target[(stage, j, direction)] = payload

    def _take(self, stage: int, j: int, direction: int) -> Any:
        key = (stage, j, direction)
        if key not in self.inbox:
            what = "input" if direction == _FORWARD else "output gradient"
            recv = "RECV_F" if direction == _FORWARD else "RECV_B"
            raise StepError(
                f"stage {stage} has no {what} for microbatch {j}: the schedule lacks the "
                f"{stage}{recv}{j} before it (run schedules lowered by "
                "mpar.schedule.executable_schedule)"
            )
        return self.inbox.pop(key)

    def _stage_input(self, s: int, j: int) -> tuple[Any, ...]:
        payload = self._take(s, j, _FORWARD)
        return tuple(_as_inputs(payload)) if self.training else tuple(payload)

    # -- actions -----------------------------------------------------------------

    def _run(self, s: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sharded = self.sharded
        if sharded is not None:
            sharded.wait_unsharded(s)  # a prefetched gather must land first
        stage = self.stages.modules[s]
        counting = self.training and torch.is_grad_enabled()
        known = _SAVED_BYTES.setdefault(stage, {})
        key = _signature((args, tuple(kwargs), kwargs, stage.training)) if counting else None
        counter = _SavedBytes(self.excluded_storages) if counting and key not in known else None
        try:
            with counter or contextlib.nullcontext():
                output = run_stage(stage, args, kwargs, self.st.config, self.st.device)
        finally:
            if sharded is not None:
                sharded.after_forward(s)
        if counter is not None:
            if len(known) >= _SIGNATURES_KEPT:
                known.pop(next(iter(known)))
            known[key] = counter.bytes
        if counting:
            saved = known[key]
            self.saved_inside[(s, self.current[s])] = saved
            self.held_bytes += saved
        return output

    def forward(self, s: int, j: int) -> None:
        self.current[s] = j
        if s == self.num_stages - 1:
            self._last_stage_forward(j)
            return
        if s == 0:
            args, kwargs = cast_floats(self.inputs.pop(j), self.dtype)
        else:
            args, kwargs = self._stage_input(s, j), {}
        output = self._run(s, args, kwargs)
        _device.after_action(self.st.device)
        if not isinstance(output, tuple):
            output = (output,)
        if self.training:
            self.saved[(s, j)] = (args, output)
            self.held_bytes += _tensor_bytes((args, output))
            self.peak_activation_bytes = max(self.peak_activation_bytes, self.held_bytes)
        self._leave(s + 1, j, _FORWARD, output)

    def _last_stage_forward(self, j: int) -> None:
        self.microbatch, self.model_called = j, False
        try:
            result = self.call(j)
        finally:
            self.microbatch = None
        _device.after_action(self.st.device)
        if not self.model_called:
            raise StepError(f"step function {self.name!r} never called the model")
        check_gatherable(result)
        self.results[j] = detach_to_cpu(result)
        if len(self.results) == len(self.batches):
            self._send_outputs()

    def _prepare_backward(self, s: int, *, arm: bool) -> None:
        if self.sharded is None:
            return
        self.sharded.wait_unsharded(s)
        if s not in self.bound:
            self.sharded.bind_grads(s)  # autograd accumulates into the flat buffers
            self.bound.add(s)
        if arm and self.backward_done.get(s, 0) == len(self.batches) - 1:
            self.sharded.reduce_grads_in_backward(s)  # overlap reduction with the last B

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
        work = self.weight_work.pop((s, j), None)
        if work is None:
            raise StepError(f"internal: {s}W{j} runs before {s}I{j}")
        work()
        _device.after_action(self.st.device)
        self._weights_done(s)

    def _weights_done(self, s: int) -> None:
        self.backward_done[s] = self.backward_done.get(s, 0) + 1

    def _backward_input(self, s: int, j: int, *, split: bool) -> None:
        inputs, outputs = self.saved.pop((s, j))
        self.held_bytes -= _tensor_bytes((inputs, outputs)) + self.saved_inside.pop((s, j), 0)
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor] | None = None
        if s == self.num_stages - 1:
            loss = self.losses.pop(j, None)
            if loss is not None:
                scaled = loss * self.batches.weights[j] / self.st.grid.dp_size
                if self.loss_scale != 1.0:  # fp16: dynamic loss scaling
                    scaled = scaled * self.loss_scale
                roots = [scaled]
        else:
            out_grads = self._take(s, j, _BACKWARD)
            if out_grads is not None:
                roots, root_grads = _gradient_pairs(outputs, out_grads)
        grads, work = None, _nothing
        if roots:
            if split:
                work = split_backward(
                    roots, root_grads, inputs, split=self.st.config.split_backward
                )
            else:
                try:
                    torch.autograd.backward(roots, root_grads)
                finally:
                    if self.sharded is not None:
                        self.sharded.after_backward(s)
            grads = _input_grads(inputs)
        if split:
            self.weight_work[(s, j)] = work
        _device.after_action(self.st.device)
        if s > 0:
            self._leave(s - 1, j, _BACKWARD, grads)

    # -- the whole step ------------------------------------------------------------

    def _handlers(self) -> dict[str, Callable[[Any], None]]:
        """One handler per action kind of the schedule."""
        handlers: dict[str, Callable[[Any], None]] = {
            "F": lambda a: self.forward(a.stage, a.microbatch),
            "B": lambda a: self.backward(a.stage, a.microbatch),
            "I": lambda a: self.backward_input(a.stage, a.microbatch),
            "W": lambda a: self.backward_weight(a.stage, a.microbatch),
            "SEND_F": lambda a: self.send(a, backward=False),
            "SEND_B": lambda a: self.send(a, backward=True),
            "RECV_F": lambda a: self.receive(a, backward=False),
            "RECV_B": lambda a: self.receive(a, backward=True),
        }
        if self.sharded is not None:
            for kind, method in _SHARD_ACTIONS.items():
                handlers[kind] = _stage_wide(getattr(self.sharded, method))
            handlers["UNSHARD"] = self._unshard
        return handlers

    def _unshard(self, action: Any) -> None:
        """UNSHARD: start the stage's gathers (with unit groups, the group its next
        computation starts with: the first for a forward, the last for a backward)."""
        assert self.sharded is not None
        backward = self.unshard_for_backward.get(action.stage, [])
        self.sharded.start_unshard(action.stage, backward=backward.pop(0) if backward else False)

    def run(self) -> StepOutput:
        """Execute this rank's actions; every replica's outputs (also ``self.outputs``)."""
        stages_here = set(self.stages.modules)
        if self.sharded is not None:
            self.sharded.reset_peak()
        self._post_receives()
        if 0 in stages_here and self.num_stages > 1:
            self.capture_inputs()
        handlers = self._handlers()
        self.unshard_for_backward = _unshard_phases(self.actions)
        timeline = self.timeline
        for action in self.actions:
            PROGRESS.begin(action)  # the hang watchdog's view of this rank; ~free
            handler = handlers.get(action.kind.value)
            if handler is None:
                raise StepError(f"the pipeline runtime cannot execute action {action}")
            if timeline is None:
                handler(action)
            else:
                start, waited = time.time(), timeline.waited
                handler(action)
                end = time.time()
                timeline.actions.append((str(action), start, end, timeline.waited - waited))
        if self.outbox:
            label = next(iter(self.outbox))
            raise StepError(
                f"the schedule never sent stage {label[0]}'s "
                f"{'input' if label[2] == _FORWARD else 'output gradient'} for microbatch "
                f"{label[1]} (no SEND action after the computation that produced it)"
            )
        # Outputs first: their senders wait for this receive before any collective below.
        self.outputs = self._gather_outputs()
        self.pending.wait()
        if self.sharded is not None and self.training:
            self.sharded.finish_grads()
        return self.outputs

    def _send_outputs(self) -> None:
        """Send this replica's outputs to every other rank as soon as the last one exists."""
        st = self.st
        mine = ([self.results[j] for j in range(len(self.batches))], list(self.batches.sizes))
        self.own_outputs = mine
        for dst in range(st.layout.world_size):
            if dst != st.layout.rank:
                send_payload(
                    mine, dst, _OUTPUTS_TAG, (st.grid.dp_rank,), self.pending, self.links, self.wire
                )

    def _gather_outputs(self) -> StepOutput:
        """Every replica's outputs, in data-parallel order (the same StepOutput on every rank)."""
        st = self.st
        outputs: list[Any] = []
        sizes: list[int] = []
        for d, src in enumerate(self._output_ranks()):
            if src == st.layout.rank:
                outs, replica_sizes = self.own_outputs
            else:
                stream = (src, _OUTPUTS_TAG)
                received = recv_payload(*stream, (d,), self.wire, self.links)
                self.incoming[stream] -= 1
                outs, replica_sizes = detach_to_cpu(received)
            outputs.extend(outs)
            sizes.extend(replica_sizes)
        return StepOutput(outputs, sizes)
