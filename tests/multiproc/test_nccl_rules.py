"""The NCCL-rules transport (config key ``nccl_rules``) enforces NCCL's point-to-point
rules on gloo, and is checked against torch's own schedules, which obey them.

* the rules themselves: per-pair FIFO matching whatever each side meant, a send that
  completes only once its receive is posted, crossing operations that deadlock unless
  grouped, mismatched shapes reported on both sides;
* torch.distributed.pipelining's ``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble``,
  their transfers routed through the transport, train as one process does;
* the order mpar used before (the first receive of every stream posted at the start
  of the step) deadlocks under it, and says so within seconds.

mpar's own schedules under the transport are in the transparency tests
(``test_pipeline_transparency.py``, ``test_zero_pipeline.py``, ``test_zero_bubble.py``,
``test_tensor_parallel.py``: their ``nccl_rules`` cases).
"""

from __future__ import annotations

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import batch, loss_fn, make_optimizer, mlp, reference


def _rules():
    """A gloo world and the transport on a group of its own (no ``mpar.init``)."""
    import torch.distributed as dist

    from mpar.comm._nccl_rules import NcclRules

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    return NcclRules(dist.new_group(backend="gloo"), rank, size), rank


def _close(rules):
    import torch.distributed as dist

    dist.barrier()
    rules.close()
    dist.destroy_process_group()


def _rules_case(case):
    import time

    import torch.distributed as dist

    from mpar.errors import CommError

    rules, rank = _rules()
    other = 1 - rank
    if case == "fifo":  # rank 1 waits for its third receive first: order, not intent, matches
        if rank == 0:
            for g in [rules.post([(True, 1, torch.full((3,), float(i)), "")]) for i in range(3)]:
                g.wait()
            out = None
        else:
            buffers = [torch.empty(3) for _ in range(3)]
            for g in [rules.post([(False, 0, b, "")]) for b in buffers][::-1]:
                g.wait()
            out = [b.tolist() for b in buffers]
    elif case == "matched":  # a send is not complete before its receive is posted
        if rank == 0:
            send = rules.post([(True, 1, torch.ones(2), "")])
            dist.barrier()
            before = send.is_completed()
            dist.barrier()
            send.wait()
            out = before
        else:
            dist.barrier()
            dist.barrier()  # only now does rank 1 post the receive
            received = torch.empty(2)
            rules.post([(False, 0, received, "")]).wait()
            out = received.tolist()
    else:  # each rank receives from the other, then sends to it
        received = torch.empty(4)
        recv = (False, other, received, "the receive")
        send = (True, other, torch.full((4,), float(rank)), "the send")
        start = time.monotonic()
        try:
            if case == "grouped":
                rules.post([recv, send]).wait()
            elif case == "crossing":
                r, s = rules.post([recv]), rules.post([send])
                r.wait()
                s.wait()
            else:  # "mismatch": rank 1 expects 5 values where rank 0 sends 4
                if rank == 1:
                    received = torch.empty(5)
                rules.post(
                    [(rank == 0, other, torch.ones(4) if rank == 0 else received, "x")]
                ).wait()
            out = received.tolist()
        except CommError as exc:
            out = (str(exc), time.monotonic() - start)
            dist.barrier()
            dist.destroy_process_group()  # (its queues are stuck: no close)
            return out
    _close(rules)
    return out


@pytest.mark.timeout(60)
def test_sends_and_receives_match_in_posting_order_and_a_send_waits_for_its_receive():
    _, received = run_distributed(_rules_case, 2, args=("fifo",), timeout=50)
    assert received == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
    before, value = run_distributed(_rules_case, 2, args=("matched",), timeout=50)
    assert before is False and value == [1.0, 1.0]


@pytest.mark.timeout(60)
def test_crossing_operations_complete_as_one_group_and_deadlock_apart():
    grouped = run_distributed(_rules_case, 2, args=("grouped",), timeout=50)
    assert grouped == [[1.0] * 4, [0.0] * 4]
    for rank, (message, seconds) in enumerate(
        run_distributed(_rules_case, 2, args=("crossing",), timeout=50)
    ):
        assert message.startswith(
            f"nccl_rules: deadlock between ranks {rank} and {1 - rank} under NCCL's "
            "point-to-point rules"
        ), message
        assert "crossing sends and receives together as one group" in message
        assert seconds < 5  # reported, not left to hang


@pytest.mark.timeout(60)
def test_a_send_matched_with_a_receive_of_another_shape_fails_on_both_ranks():
    sender, receiver = run_distributed(_rules_case, 2, args=("mismatch",), timeout=50)
    assert sender[0] == (
        "nccl_rules: rank 0's send #0 to rank 1 (float32 [4]; x) was matched with rank 1's "
        "receive #0 from rank 0, which expects float32 [5]: the two ranks post their "
        "transfers in different orders (NCCL would deliver the wrong bytes or hang)"
    )
    assert receiver[0].startswith(
        "nccl_rules: rank 1's receive #0 from rank 0 (float32 [5]; x) was matched with "
        "rank 0's send #0, which sends float32 [4]"
    )


# -- torch's own schedules through the transport -------------------------------------------

STEPS, MICROBATCHES = 3, 4
SPLITS = {
    "Schedule1F1B": [(0, 5), (5, 9)],
    "ScheduleInterleavedZeroBubble": [(0, 3), (3, 5), (5, 7), (7, 9)],
}
"""The MLP's nine modules per stage; stage ``s`` is on rank ``s % 2``."""


def _torch_schedule(name):
    """Train the MLP with torch's schedule ``name`` on two ranks, its transfers (every
    ``_batch_p2p`` of the schedule: homogeneous batches one by one, mixed ones as one
    group, as torch posts them) through the NCCL-rules transport."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    rules, rank = _rules()
    routed = []

    def batch_p2p(ops, desc=None):
        items = [(op.op is dist.isend, op.peer, op.tensor, desc or "") for op in ops]
        routed.append(len(items))
        if len({send for send, *_ in items}) == 1:
            return [rules.post([item]) for item in items]
        return [rules.post(items)]

    schedules._batch_p2p = batch_p2p  # _sorted_batch_p2p calls it too
    layers = list(mlp())
    splits = SPLITS[name]
    mine = [s for s in range(len(splits)) if s % 2 == rank]
    modules = {s: torch.nn.Sequential(*layers[a:b]) for s, (a, b) in enumerate(splits)}
    stages = [PipelineStage(modules[s], s, len(splits), torch.device("cpu")) for s in mine]
    params = [p for s in mine for p in modules[s].parameters()]
    opt = make_optimizer("sgd", params)
    if name == "Schedule1F1B":
        schedule = schedules.Schedule1F1B(stages[0], MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = schedules.ScheduleInterleavedZeroBubble(stages, MICROBATCHES, loss_fn=loss_fn)
    losses = []
    for step in range(STEPS):
        x, y = batch("mlp", step)
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x, target=y, losses=step_losses)
        else:
            schedule.step(target=y, losses=step_losses)
        opt.step()
        opt.zero_grad()
        losses.append(float(torch.stack(step_losses).mean()) if step_losses else None)
    state = {}
    for s in mine:  # the whole model's keys: "{module index}.{name}"
        for key, value in modules[s].state_dict().items():
            index, name = key.split(".", 1)
            state[f"{splits[s][0] + int(index)}.{name}"] = value.clone()
    _close(rules)
    return {"losses": losses, "state": state, "routed": sum(routed)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SPLITS))
def test_torch_schedules_train_as_one_process_under_the_rules(name):
    results = run_distributed(_torch_schedule, 2, args=(name,), timeout=110)
    ref = reference("mlp", "sgd", STEPS)
    last = len(SPLITS[name]) - 1
    losses = results[last % 2]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]))
    got = {k: v for r in results for k, v in r["state"].items()}
    assert set(got) == set(ref["state"])
    for key, value in ref["state"].items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(r["routed"] >= 2 * STEPS * MICROBATCHES for r in results)


# -- the order mpar used before ---------------------------------------------------------


def _old_order(early):
    """pp=2 1F1B, m=4, the transfers alone (8 floats each), in the order mpar used before
    ``receive_posts``: ``early``: the first receive of every stream posted at the start
    of the step and the next one after each wait (the default then); otherwise each
    receive posted at its RECV action, sends apart from it (what removing the early
    receives alone gives)."""
    import time

    import mpar
    from mpar.comm import state
    from mpar.errors import CommError
    from mpar.schedule import Kind, executable_schedule

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 4, "nccl_rules": True})
    links, me = state().p2p_links, mpar.pp_rank()
    other = 1 - me
    actions = executable_schedule("interleaved", 2, 4).actions[me]
    streams: dict[tuple[Kind, int], list] = {}
    for a in actions:
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            streams.setdefault((a.kind, a.stage), []).append(a)
    posted = {}

    def post(action):
        buffer = torch.empty(8)
        posted[action] = links.recv(buffer, other, str(action))

    if early:
        for stream in streams.values():
            post(stream[0])
    sends, start = [], time.monotonic()
    try:
        for a in actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sends.append(links.send(torch.full((8,), float(a.microbatch)), other, str(a)))
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                if not early:
                    post(a)
                posted.pop(a).wait()
                stream = streams[(a.kind, a.stage)]
                following = stream[stream.index(a) + 1 :]
                if early and following:
                    post(following[0])
        for send in sends:
            send.wait()
    except CommError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "early",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["early_receives", "receives_at_recv"],
)
def test_the_order_mpar_used_before_deadlocks_under_the_rules(early):
    for rank, (message, seconds) in enumerate(
        run_distributed(_old_order, 2, args=(early,), timeout=50)
    ):
        assert message.startswith(f"nccl_rules: deadlock between ranks {rank} and {1 - rank}"), (
            message
        )
        assert seconds < 5
    # (mpar's order now, from mpar.schedule.receive_posts, trains under the same rules:
    # the nccl_rules cases of the transparency tests)
