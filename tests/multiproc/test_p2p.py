"""Pipeline transfers reuse their sent messages without mixing up what they carry."""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

TRANSPORTS = ["backend", "shared_memory", "nccl_rules"]


def _config(transport):
    """Two pipeline ranks: their transfers go through shared memory, gloo, or the
    NCCL-rules transport (which runs the device path: data without control words)."""
    return {
        "timeout_s": 30,
        "pipeline_parallel_degree": 2,
        "shared_memory": transport == "shared_memory",
        "nccl_rules": transport == "nccl_rules",
    }


STEPS = [
    ("a", [(4, 8)] * 3 + [(2, 3)] * 2),
    ("b", [(2, 3)] * 5),
    ("a", [(4, 8)] * 3 + [(2, 3)] * 2),
]
"""Steps (signature, each microbatch's payload shape): the first step of a signature
agrees its transfers' shapes, a later step with that signature sends data alone."""


def _steps(transport):
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    mpar.init(_config(transport))
    links, pending = state().p2p_links, PendingSends()
    assert (links.shared is not None) == (transport == "shared_memory")
    assert (links.rules is not None) == (transport == "nccl_rules")
    sent, reused, received = [], 0, []  # (every message kept alive: no address given twice)
    for step, (signature, shapes) in enumerate(STEPS):
        links.begin(signature)
        for j, shape in enumerate(shapes):
            label = TransferLabel(Transfer.ACTIVATIONS, 1, j)
            if mpar.rank() == 0:
                value = torch.full(shape, float(10 * step + j))
                send_payload((value,), 1, label, pending, links)
                reused += any(m is pending.buffers[-1] for m in sent)
                sent.append(pending.buffers[-1])
                if transport != "nccl_rules":  # (the data path sends the tensor itself)
                    value.fill_(-1.0)  # the host message holds its own copy
                if j % 2:
                    pending.wait()  # these messages may now be written again
            else:
                (tensor,) = recv_payload(0, label, torch.device("cpu"), links)
                received.append((tuple(tensor.shape), tensor.unique().tolist()))
        pending.wait()
        links.end()
    return reused, received


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_signature_agrees_its_shapes_once_and_payloads_arrive_intact(transport):
    (reused, _), (_, received) = run_distributed(_steps, 2, args=(transport,), timeout=50)
    want = [
        (shape, [float(10 * step + j)])
        for step, (_, shapes) in enumerate(STEPS)
        for j, shape in enumerate(shapes)
    ]
    assert received == want
    if transport != "nccl_rules":  # steady host messages are written again once sent
        assert reused >= 2


def _payload(j):
    """A steady-state payload of every kind of tensor a stage may send: float32 that
    requires grad and is not contiguous, bfloat16 (which numpy cannot hold), float16,
    int64, bool, a 0-d tensor, and a value that is no tensor."""
    import torch

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + j
    return (
        (base * 1.5).t().requires_grad_(),  # a transposed view
        (base / 7).to(torch.bfloat16),
        (base / 3).to(torch.float16),
        base.to(torch.int64) * -3,
        base.to(torch.int64) % 2 == 0,
        torch.tensor(j + 0.25, dtype=torch.float64),
        None,
    )


def _mixed(transport):
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    mpar.init(_config(transport))
    links, pending = state().p2p_links, PendingSends()
    cpu = torch.device("cpu")
    label, nothing = (
        TransferLabel(Transfer.GRADIENTS, 0, 0),
        TransferLabel(Transfer.GRADIENTS, 0, 1),
    )
    out = []
    for j in range(4):  # steps of one signature: the first agrees, the others send data
        links.begin("one signature")
        if mpar.rank() == 0:
            send_payload(_payload(j), 1, label, pending, links)
            send_payload((None, None), 1, nothing, pending, links)  # no gradient: no data
            if j % 2:
                pending.wait()
        else:
            got = recv_payload(0, label, cpu, links)
            assert recv_payload(0, nothing, cpu, links) == (None, None)
            out.append([_described(t) for t in got])
        pending.wait()
        links.end()
    return out


def _described(t):
    if t is None:
        return None
    return (t.dtype, tuple(t.shape), t.requires_grad, t.tolist())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_steady_messages_carry_every_dtype_and_layout_exactly(transport):
    # the steady state writes host messages through numpy where the dtype allows; under
    # nccl_rules it sends the data alone, as a device transport does
    _, received = run_distributed(_mixed, 2, args=(transport,), timeout=50)
    for j, got in enumerate(received):
        assert got == [_described(t) for t in _payload(j)]


def _bytes(j, size):
    import torch

    return ((torch.arange(size, dtype=torch.int64) * 7 + j) % 251).to(torch.uint8)


def _rings(full):
    """Both ranks send two bursts to each other before receiving any: more than a ring
    holds, and messages larger than a ring. What finds no room in the ring goes through
    the backend, in the pair's order. ``full``: /dev/shm has no room
    for a whole ring (one too large to reserve is asked for), so a small one is made."""
    import os

    import torch

    import mpar
    from mpar.comm import _shared, state
    from mpar.comm._p2p import PendingSends

    if full:
        _shared.RING_BYTES = 1 << 50
    mpar.init(_config("shared_memory"))
    links, pending = state().p2p_links, PendingSends()
    assert links.shared is not None
    token = links.shared.token
    other = 1 - mpar.rank()
    sizes = [1, 100, 64 << 10, (4 << 20) + 5, 1 << 20] + [1 << 20] * 6 + [12_345, 5, 3 << 20]
    for burst in (5, 6):  # two bursts in each direction, all sent before any is received
        for j, size in enumerate(sizes):
            pending.add(_bytes(j + burst, size), other, links)
    through_ring = sum(work is None for work in pending.works)
    ok = []
    posted = [
        (torch.empty(size, dtype=torch.uint8), j + burst)
        for burst in (5, 6)
        for j, size in enumerate(sizes)
    ]
    receives = [links.recv(buffer, other) for buffer, _ in posted]
    for receive in receives[::-1]:  # (waiting for the last takes the earlier ones first)
        receive.wait()
    ok.extend(torch.equal(buffer, _bytes(j, buffer.numel())) for buffer, j in posted)
    pending.wait()
    # the ring is empty again: the next message goes through it
    pending.add(_bytes(5, 3 << 20), other, links)
    after = sum(work is None for work in pending.works)
    capacities = {ring.capacity for ring in links.shared._rings_out.values()}
    buffer = torch.empty(3 << 20, dtype=torch.uint8)
    links.recv(buffer, other).wait()
    ok.append(torch.equal(buffer, _bytes(5, 3 << 20)))
    pending.wait()
    mpar.barrier()
    mpar.shutdown()
    left = [name for name in os.listdir(_shared.ROOT) if token in name]
    return all(ok), len(ok), through_ring, len(sizes) * 2, after, capacities, left


@pytest.mark.timeout(90)
@pytest.mark.parametrize("full", [False, True], ids=["room", "dev_shm_full"])
def test_shared_memory_rings_carry_bursts_both_ways_and_leave_no_files(full):
    from mpar.comm import _shared

    results = run_distributed(_rings, 2, args=(full,), timeout=80)
    for intact, count, through_ring, sent, after, capacities, left in results:
        assert intact and count == 29
        assert 0 < through_ring < sent  # some found room in the ring, some did not
        assert after == (0 if full else 1)  # 3 MiB: in an emptied ring, unless it is small
        assert capacities == {_shared.SMALL_RING_BYTES if full else _shared.RING_BYTES}
        assert left == []


def test_shared_memory_key_must_be_a_bool():
    from mpar.config import load_config
    from mpar.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError, match="shared_memory"):
        load_config({"shared_memory": "yes"})
