"""One step's pipeline transfers on one rank: what the stages left for each other.

Every value that crosses from one stage to the next is keyed by its
:class:`~mpar.comm._types.TransferLabel` (the receiving stage, the microbatch,
activations or gradients). A stage's computation *leaves* its result for the
receiving stage: in the :attr:`Transfers.inbox` when that stage is on this rank,
else in the :attr:`Transfers.outbox` for the SEND action that follows. RECV
actions fill the inbox from the wire; the computation that needs a value
*takes* it from there.

Receives are *posted* early: at the start of the step the first receive of
every incoming stream, and after each receive the next one on its stream, so
the bytes arrive while this rank computes and the RECV action's wait is short.
The rank of a replica's last stage sends that replica's step outputs to every
other rank as soon as its last forward is done (point to point, posted early
like the rest), so the step ends without a collective of its own.
"""

from __future__ import annotations

import time

from mpar import _device
from mpar.comm import State
from mpar.comm._p2p import Links, PendingSends, recv_payload, send_payload
from mpar.comm._types import Transfer, TransferLabel
from mpar.errors import StepError
from mpar.runtime._output import StepOutput, detach_to_cpu
from mpar.runtime._timeline import StepTimeline
from mpar.schedule import Action, Kind, Schedule

__all__ = ["Transfers"]

_OUTPUTS_TAG = 1 << 20
"""The stream carrying step outputs (p2p tags of stage transfers are ``2 * stage + kind``)."""
ReplicaOutputs = tuple[list[object], list[int]]
"""One replica's step outputs: each microbatch's result, and each microbatch's size."""


def _tag(label: TransferLabel) -> int:
    """The p2p tag of the stream that carries transfers like ``label``."""
    return 2 * label.stage + label.kind


class Transfers:
    """This rank's transfers of one step: its inbox, outbox, and the sends in flight."""

    def __init__(self, schedule: Schedule, st: State, timeline: StepTimeline | None) -> None:
        self.schedule, self.st, self.timeline = schedule, st, timeline
        self.num_stages = schedule.num_stages
        self.inbox: dict[TransferLabel, object] = {}
        """What a stage's F or B takes: received by a RECV action, or left by the
        neighbouring stage when it is on this rank."""
        self.outbox: dict[TransferLabel, object] = {}
        """What a SEND action still has to send."""
        self.pending = PendingSends()
        self.links: Links = st.p2p_links
        self.wire = _device.p2p_device(st.device, st.backend)
        """Where transfers are built and received (the host when they are staged)."""
        self.staged = self.wire != st.device
        """Whether received values move from the wire to the device."""
        pp_ranks = st.grid.pp_ranks
        self.stage_ranks = [pp_ranks[schedule.stage_to_rank(s)] for s in range(self.num_stages)]
        """Global rank of this replica that holds each stage."""
        self.me = st.layout.rank
        self.incoming = self._incoming_streams(schedule.actions.get(st.grid.pp_rank, []))
        """(source rank, tag) -> transfers still to receive on that stream this step."""
        self.own_outputs: ReplicaOutputs = ([], [])

    def _rank_of(self, stage: int) -> int:
        """Global rank of this replica that holds ``stage``."""
        return self.stage_ranks[stage]

    def _incoming_streams(self, actions: list[Action]) -> dict[tuple[int, int], int]:
        """How many transfers this rank receives this step on each (source, tag) stream:
        one per RECV action, and the step outputs of every other replica."""
        counts: dict[tuple[int, int], int] = {}
        for action in actions:
            if action.kind is Kind.RECV_F or action.kind is Kind.RECV_B:
                kind = Transfer.GRADIENTS if action.kind is Kind.RECV_B else Transfer.ACTIVATIONS
                stream = self._recv_stream(TransferLabel(kind, action.stage))
                counts[stream] = counts.get(stream, 0) + 1
        me = self.st.layout.rank
        for src in self.output_ranks():
            if src != me:
                counts[(src, _OUTPUTS_TAG)] = 1
        return counts

    def _recv_stream(self, label: TransferLabel) -> tuple[int, int]:
        """(source rank, tag) of the stream that carries ``label`` here."""
        source = label.stage + 1 if label.kind is Transfer.GRADIENTS else label.stage - 1
        if not 0 <= source < self.num_stages:
            raise StepError(f"internal: stage {label.stage} receives nothing in that direction")
        return self._rank_of(source), _tag(label)

    def output_ranks(self) -> list[int]:
        """Global rank of each data-parallel replica's last stage (where its outputs are;
        TP and CP rank 0 of it, which sends them)."""
        grid = self.st.grid
        last = self.schedule.stage_to_rank(self.num_stages - 1)
        return [grid.rank_of(last, d) for d in range(grid.dp_size)]

    def post_receives(self) -> None:
        """Post the first receive of every incoming stream (at the start of the step)."""
        for src, tag in self.incoming:
            self.links.post(src, tag, self.wire)

    def receive(self, label: TransferLabel) -> None:
        """RECV_F / RECV_B: wait for ``label`` and keep it for the F (or B / I) that follows."""
        stream = self._recv_stream(label)
        timeline = self.timeline
        started = time.time() if timeline is not None else 0.0
        payload = recv_payload(*stream, label, self.wire, self.links)
        if timeline is not None:
            timeline.waited += time.time() - started
        self.incoming[stream] -= 1
        if self.incoming[stream] > 0:
            self.links.post(*stream, self.wire)
        self.inbox[label] = _device.to_device(payload, self.st.device) if self.staged else payload

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
        dst = self._rank_of(label.stage)
        payload = self.outbox.pop(label)
        send_payload(payload, dst, _tag(label), label, self.pending, self.links, self.wire)

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

    def send_outputs(self, outputs: ReplicaOutputs) -> None:
        """Send this replica's outputs to every other rank as soon as the last one exists
        (TP and CP rank 0 sends for its TP and CP groups, whose ranks hold the same
        outputs: the CP group's combined)."""
        st = self.st
        self.own_outputs = outputs
        if st.grid.tp_rank != 0 or st.grid.cp_rank != 0:
            return
        label = TransferLabel.outputs(st.grid.dp_rank)
        for dst in range(st.layout.world_size):
            if dst != st.layout.rank:
                send_payload(outputs, dst, _OUTPUTS_TAG, label, self.pending, self.links, self.wire)

    def gather_outputs(self) -> StepOutput:
        """Every replica's outputs, in data-parallel order (the same StepOutput on every rank)."""
        outputs: list[object] = []
        sizes: list[int] = []
        for d, src in enumerate(self.output_ranks()):
            if src == self.st.layout.rank:
                outs, replica_sizes = self.own_outputs
            else:
                stream = (src, _OUTPUTS_TAG)
                received = recv_payload(*stream, TransferLabel.outputs(d), self.wire, self.links)
                self.incoming[stream] -= 1
                if not isinstance(received, tuple):  # what send_outputs sent
                    raise StepError(f"internal: rank {src} sent {type(received).__name__} outputs")
                outs, replica_sizes = detach_to_cpu(received)
            outputs.extend(outs)
            sizes.extend(replica_sizes)
        return StepOutput(outputs, sizes)
