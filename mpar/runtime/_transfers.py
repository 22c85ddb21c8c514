"""One step's pipeline transfers on one rank: what the stages left for each other.

Every value that crosses from one stage to the next is keyed by its
:class:`~mpar.comm._types.TransferLabel` (the receiving stage, the microbatch,
activations or gradients). A stage's computation *leaves* its result for the
receiving stage: in the :attr:`Transfers.inbox` when that stage is on this rank,
else in the :attr:`Transfers.outbox` for the SEND action that follows. RECV
actions fill the inbox from the wire; the computation that needs a value
*takes* it from there.

Order. Receives are posted where :func:`mpar.schedule.receive_posts` puts them
(:attr:`Transfers.posts`: before which action of this rank's list), sends at their
SEND action, and a RECV action waits for its posted receive. Both ends of every
pair derive that order from the same lowered schedule, and it is free of deadlocks
under NCCL's point-to-point rules (per-pair order, each operation complete only
once matched), so gloo, the shared-memory rings and NCCL run the same order. Receives
are posted as early as that allows, so the bytes arrive while this rank computes.

Agreement. The shapes of a step's transfers follow from its *signature*
(:func:`step_signature`: the model, the step function, whether it trains, and every
microbatch's argument shapes and dtypes); the first step with a signature agrees
them (``mpar.comm._p2p``), later ones send data of known sizes, which device
transports receive without the host reading anything.

Step outputs come back by collectives at the end of the step: a broadcast within
each pipeline from the rank of its last stage, then an all-gather over the
data-parallel group (``mpar.comm._collectives.gather_step_outputs``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

from mpar import _device
from mpar.comm import State, _process_state
from mpar.comm._collectives import gather_step_outputs
from mpar.comm._p2p import Incoming, Links, PendingSends, post_payload, send_payload, take_payload
from mpar.comm._types import Transfer, TransferLabel
from mpar.errors import StepError
from mpar.runtime._microbatch import Microbatches
from mpar.runtime._output import StepOutput
from mpar.runtime._timeline import StepTimeline
from mpar.schedule import Action, Kind, Schedule, receive_posts

__all__ = ["Transfers", "step_signature"]

ReplicaOutputs = tuple[list[object], list[int], torch.Tensor | None]
"""One replica's step outputs: each microbatch's result, size and (where the step's
arguments held integer ``labels``) number of kept targets."""
_PLANS: dict[int, tuple[Schedule, dict[int, list[tuple[TransferLabel, ...]]]]] = {}
"""id(schedule) -> (the schedule, its receive posts as labels per rank): schedules are
built once per model and kept, so this stays small."""
_PLANS_KEPT = 16
_process_state.register("mpar.runtime._transfers._PLANS", _PLANS.clear, lambda: not _PLANS)


def step_signature(
    model: object, fn: Callable[..., object], batches: Microbatches, training: bool
) -> Hashable:
    """What the shapes of a step's transfers follow from: the model (by identity: two
    models trained by one step function on alike batches send different things), the
    step function's code, whether it trains, and each microbatch's arguments (tensors
    by shape, dtype and ``requires_grad``; numbers, strings and None by value; other
    objects by type). Every rank of a pipeline builds its models in the same order and
    is given the same batch, so every one computes the same.

    ``model`` is held by the signature (not its ``id``): while the agreed specs are
    kept, no later model can take its place."""
    code = getattr(fn, "__code__", fn)
    parts = [_shapes(args) + _shapes(kwargs) for args, kwargs in zip(batches.args, batches.kwargs)]
    return (_Identity(model), code, training, tuple(batches.sizes), tuple(parts))


class _Identity:
    """Hashes and compares ``value`` by identity, holding it."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


def _shapes(value: object) -> tuple[object, ...]:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, tuple | list):
        return (type(value).__name__, *(_shapes(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _shapes(v)) for k, v in value.items()))
    if value is None or isinstance(value, bool | int | float | str):
        return (value,)
    return (type(value).__qualname__,)


def _label(action: Action) -> TransferLabel:
    kind = Transfer.GRADIENTS if action.kind is Kind.RECV_B else Transfer.ACTIVATIONS
    return TransferLabel(kind, action.stage, action.microbatch or 0)


def _posts(schedule: Schedule, pp_rank: int) -> list[tuple[TransferLabel, ...]]:
    """This rank's receive posts of ``schedule``, as labels, per action index (cached)."""
    found = _PLANS.get(id(schedule))
    if found is None or found[0] is not schedule:
        if len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
        posts = receive_posts(schedule)
        labels = {r: [tuple(_label(a) for a in at) for at in p] for r, p in posts.items()}
        found = _PLANS[id(schedule)] = (schedule, labels)
    return found[1].get(pp_rank, [])


class Transfers:
    """This rank's transfers of one step: its inbox, outbox, and the sends in flight."""

    def __init__(
        self,
        schedule: Schedule,
        st: State,
        timeline: StepTimeline | None,
        signature: Hashable = None,
    ) -> None:
        self.schedule, self.st, self.timeline = schedule, st, timeline
        self.num_stages = schedule.num_stages
        self.inbox: dict[TransferLabel, object] = {}
        """What a stage's F or B takes: received by a RECV action, or left by the
        neighbouring stage when it is on this rank."""
        self.outbox: dict[TransferLabel, object] = {}
        """What a SEND action still has to send."""
        self.posted: dict[TransferLabel, Incoming] = {}
        """Receives posted and not yet taken by their RECV action."""
        self.pending = PendingSends()
        self.links: Links = st.p2p_links
        self.links.begin(signature)
        self.wire = _device.p2p_device(st.device, st.backend)
        """Where transfers are built and received (the host when they are staged)."""
        self.staged = self.wire != st.device
        """Whether received values move from the wire to the device."""
        pp_ranks = st.grid.pp_ranks
        self.stage_ranks = [pp_ranks[schedule.stage_to_rank(s)] for s in range(self.num_stages)]
        """Global rank of this replica that holds each stage."""
        self.me = st.layout.rank
        self.posts = _posts(schedule, st.grid.pp_rank)
        """For each of this rank's actions (by index), the receives to post before it."""
        self.own_outputs: ReplicaOutputs | None = None

    def _source(self, label: TransferLabel) -> int:
        """Global rank that sends ``label`` here."""
        source = label.stage + 1 if label.kind is Transfer.GRADIENTS else label.stage - 1
        if not 0 <= source < self.num_stages:
            raise StepError(f"internal: stage {label.stage} receives nothing in that direction")
        return self.stage_ranks[source]

    def post(self, labels: tuple[TransferLabel, ...]) -> None:
        """Post the receives the schedule's order puts before the next action."""
        for label in labels:
            self.posted[label] = post_payload(self._source(label), label, self.wire, self.links)

    def receive(self, label: TransferLabel) -> None:
        """RECV_F / RECV_B: wait for ``label`` and keep it for the F (or B / I) that follows."""
        incoming = self.posted.pop(label, None)
        if incoming is None:
            raise StepError(
                f"internal: the receive of {label.describe()} was never posted (run "
                "schedules lowered by mpar.schedule.executable_schedule)"
            )
        timeline = self.timeline
        started = time.time() if timeline is not None else 0.0
        payload = take_payload(incoming, self.links)
        if timeline is not None:
            timeline.waited += time.time() - started
        self.inbox[label] = _device.to_device(payload, self.st.device) if self.staged else payload
        self.pending.collect()  # sends done by now free their messages

    def send(self, label: TransferLabel) -> None:
        """SEND_F / SEND_B: start sending ``label`` to its stage's rank."""
        if label not in self.outbox:
            backward = label.kind is Transfer.GRADIENTS
            s, j = label.stage + 1 if backward else label.stage - 1, label.microbatch
            raise StepError(
                f"the schedule runs {s}{'SEND_B' if backward else 'SEND_F'}{j} before the "
                f"{'backward' if backward else 'forward'} of stage {s} for microbatch {j} "
                "produced what it sends"
            )
        dst = self.stage_ranks[label.stage]
        payload = self.outbox.pop(label)
        send_payload(payload, dst, label, self.pending, self.links, self.wire)

    def leave(self, label: TransferLabel, payload: object) -> None:
        """What one stage computed for ``label.stage``: into the inbox when that stage is
        on this rank, else for the SEND action that follows."""
        here = self.stage_ranks[label.stage] == self.me
        (self.inbox if here else self.outbox)[label] = payload

    def take(self, label: TransferLabel) -> object:
        """What stage ``label.stage`` computes from (removed from the inbox)."""
        if label not in self.inbox:
            forward = label.kind is Transfer.ACTIVATIONS
            what = "input" if forward else "output gradient"
            recv = "RECV_F" if forward else "RECV_B"
            raise StepError(
                f"stage {label.stage} has no {what} for microbatch {label.microbatch}: the "
                f"schedule lacks the {label.stage}{recv}{label.microbatch} before it (run "
                "schedules lowered by mpar.schedule.executable_schedule)"
            )
        return self.inbox.pop(label)

    def check_all_sent(self) -> None:
        """After the last action: every value left for another rank went out."""
        if self.outbox:
            label = next(iter(self.outbox))
            forward = label.kind is Transfer.ACTIVATIONS
            raise StepError(
                f"the schedule never sent stage {label.stage}'s "
                f"{'input' if forward else 'output gradient'} for microbatch "
                f"{label.microbatch} (no SEND action after the computation that produced it)"
            )

    def finish(self) -> None:
        """The step's transfers are done: wait for the sends; its signature is agreed."""
        self.pending.wait()
        self.links.end()

    def send_outputs(self, outputs: ReplicaOutputs) -> None:
        """This replica's outputs, once the last one exists (on the last stage's ranks)."""
        self.own_outputs = outputs

    def gather_outputs(self) -> StepOutput:
        """Every replica's outputs, in data-parallel order (the same StepOutput on every
        rank), by two collectives at the end of the step."""
        last = self.schedule.stage_to_rank(self.num_stages - 1)
        replicas = gather_step_outputs(self.own_outputs, last, self.st.grid)
        outputs: list[object] = []
        sizes: list[int] = []
        targets: list[torch.Tensor] | None = []
        for replica in replicas:
            if not isinstance(replica, tuple):  # what send_outputs kept
                raise StepError(f"internal: a replica's step outputs are {type(replica).__name__}")
            outs, replica_sizes, replica_targets = replica
            outputs.extend(outs)
            sizes.extend(replica_sizes)
            if targets is not None and replica_targets is not None:
                targets.append(replica_targets)
            else:
                targets = None  # weighed by samples unless every replica counted targets
        counted = None if not targets else torch.cat(targets)
        return StepOutput(outputs, sizes, on_device=self.st.grid.world_size == 1, targets=counted)
