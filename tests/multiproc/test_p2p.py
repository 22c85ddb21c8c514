"""Pipeline transfers reuse their sent messages without mixing up what they carry."""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

SHAPES = [(4, 8)] * 5 + [(2, 3)] * 3 + [(4, 8)] * 4
"""One stream's payloads in order: the steady state, a change of shape, and back."""


def _stream():
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    def label(j):
        return TransferLabel(Transfer.ACTIVATIONS, 1, j)

    mpar.init({"timeout_s": 30})
    links, pending = state().p2p_links, PendingSends()
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
def test_sent_messages_are_reused_and_carry_each_payload_intact():
    reused, received = run_distributed(_stream, 2, timeout=50)
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


def _mixed():
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    mpar.init({"timeout_s": 30})
    links, pending = state().p2p_links, PendingSends()
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
def test_steady_messages_carry_every_dtype_and_layout_exactly():
    # the steady state writes host messages through numpy where the dtype allows
    _, received = run_distributed(_mixed, 2, timeout=50)
    for j, got in enumerate(received):
        want = [(t.dtype, tuple(t.shape), t.requires_grad, t.tolist()) for t in _payload(j)]
        assert got == want
