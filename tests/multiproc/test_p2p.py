"""Pipeline transfers reuse their sent messages without mixing up what they carry."""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

SHAPES = [(4, 8)] * 5 + [(2, 3)] * 3 + [(4, 8)] * 4
"""One stream's payloads in order: the steady state, a change of shape, and back."""


def _config(shared):
    """Two pipeline ranks: their transfers go through shared memory unless turned off."""
    return {"timeout_s": 30, "pipeline_parallel_degree": 2, "shared_memory": shared}


def _stream(shared):
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    def label(j):
        return TransferLabel(Transfer.ACTIVATIONS, 1, j)

    mpar.init(_config(shared))
    links, pending = state().p2p_links, PendingSends()
    assert (links.shared is not None) == shared
    if mpar.rank() == 0:
        sent, reused = [], 0  # (every message kept alive: no address is given out twice)
        for j, shape in enumerate(SHAPES):
            value = torch.full(shape, float(j))
            send_payload((value,), 1, 2, label(j), pending, links)
            reused += any(m is pending.buffers[-1] for m in sent)
            sent.append(pending.buffers[-1])
            value.fill_(-1.0)  # the message holds its own copy
            if j % 3 == 2:
                pending.wait()  # these messages may now be written again
        pending.wait()
        return reused
    received = []
    for j in range(len(SHAPES)):
        links.post(0, 2, torch.device("cpu"))
        (tensor,) = recv_payload(0, 2, label(j), torch.device("cpu"), links)
        received.append((tuple(tensor.shape), tensor.unique().tolist()))
    return received


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [False, True], ids=["backend", "shared_memory"])
def test_sent_messages_are_reused_and_carry_each_payload_intact(shared):
    reused, received = run_distributed(_stream, 2, args=(shared,), timeout=50)
    assert received == [(shape, [float(j)]) for j, shape in enumerate(SHAPES)]
    assert reused >= 2  # the 4th and 5th payloads went out in the 2nd and 3rd's messages


def _payload(j):
    """A steady-state payload of every kind of tensor a stage may send: float32 that
    requires grad and is not contiguous, bfloat16 (which numpy cannot hold), float16,
    int64, bool and a 0-d tensor."""
    import torch

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + j
    return (
        (base * 1.5).t().requires_grad_(),  # a transposed view
        (base / 7).to(torch.bfloat16),
        (base / 3).to(torch.float16),
        base.to(torch.int64) * -3,
        base.to(torch.int64) % 2 == 0,
        torch.tensor(j + 0.25, dtype=torch.float64),
    )


def _mixed(shared):
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    mpar.init(_config(shared))
    links, pending = state().p2p_links, PendingSends()
    assert (links.shared is not None) == shared
    cpu = torch.device("cpu")
    out = []
    for j in range(5):
        label = TransferLabel(Transfer.GRADIENTS, 0, j)
        if mpar.rank() == 0:
            send_payload(_payload(j), 1, 3, label, pending, links)
            if j % 2:
                pending.wait()
        else:
            links.post(0, 3, cpu)
            got = recv_payload(0, 3, label, cpu, links)
            out.append([(t.dtype, tuple(t.shape), t.requires_grad, t.tolist()) for t in got])
    pending.wait()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [False, True], ids=["backend", "shared_memory"])
def test_steady_messages_carry_every_dtype_and_layout_exactly(shared):
    # the steady state writes host messages through numpy where the dtype allows
    _, received = run_distributed(_mixed, 2, args=(shared,), timeout=50)
    for j, got in enumerate(received):
        want = [(t.dtype, tuple(t.shape), t.requires_grad, t.tolist()) for t in _payload(j)]
        assert got == want


def _bytes(j, size):
    import torch

    return ((torch.arange(size, dtype=torch.int64) * 7 + j) % 251).to(torch.uint8)


def _rings(full):
    """Both ranks send bursts on two streams to each other before receiving any: more
    than a ring holds, and messages larger than a ring. What finds no room in the ring
    goes through the backend, in the stream's order. ``full``: /dev/shm has no room
    for a whole ring (one too large to reserve is asked for), so a small one is made."""
    import os

    import torch

    import mpar
    from mpar.comm import _shared, state
    from mpar.comm._p2p import PendingSends

    if full:
        _shared.RING_BYTES = 1 << 50
    mpar.init(_config(True))
    links, pending = state().p2p_links, PendingSends()
    assert links.shared is not None
    token = links.shared.token
    other = 1 - mpar.rank()
    sizes = [1, 100, 64 << 10, (4 << 20) + 5, 1 << 20] + [1 << 20] * 6 + [12_345, 5, 3 << 20]
    for tag in (5, 6):  # two streams in each direction
        for j, size in enumerate(sizes):
            pending.add(_bytes(j + tag, size), other, tag, links)
    through_ring = sum(work is None for work in pending.works)
    ok = []
    for tag in (5, 6):
        for j, size in enumerate(sizes):
            buffer = torch.empty(size, dtype=torch.uint8)
            links.recv(buffer, other, tag)
            ok.append(torch.equal(buffer, _bytes(j + tag, size)))
    pending.wait()
    # the rings are empty again: the next messages go through them
    for tag in (5, 6):
        pending.add(_bytes(tag, 3 << 20), other, tag, links)
    after = sum(work is None for work in pending.works)
    capacities = {ring.capacity for ring in links.shared._rings_out.values()}
    for tag in (5, 6):
        buffer = torch.empty(3 << 20, dtype=torch.uint8)
        links.recv(buffer, other, tag)
        ok.append(torch.equal(buffer, _bytes(tag, 3 << 20)))
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
        assert intact and count == 30
        assert 0 < through_ring < sent  # some found room in the ring, some did not
        assert after == (0 if full else 2)  # 3 MiB: in an emptied ring, unless it is small
        assert capacities == {_shared.SMALL_RING_BYTES if full else _shared.RING_BYTES}
        assert left == []


def test_shared_memory_key_must_be_a_bool():
    from mpar.config import load_config
    from mpar.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError, match="shared_memory"):
        load_config({"shared_memory": "yes"})
