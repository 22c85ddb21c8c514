"""Pipeline memory is bounded by what is in flight, not by the number of microbatches
(issue 44): a send's message is freed once the send is done, so a 1F1B step holds the
same messages at 16 microbatches as at 4, and peaks as high (sampled RSS, as DESIGN.md
measures peaks). ``benchmarks/pipeline_memory.py`` measures m = 8, 32 and 128."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from mpar.testing import run_distributed
from mpar.testing.rss import RssPeak

H, MICROBATCH, SEQ = 64, 8, 512
"""A message (one microbatch's boundary activation or gradient) is 8 x 512 x 64 fp32:
1 MiB, above the size the runtime keeps sent messages for reuse."""
MIB = 2**20


def _held_sends() -> list[int]:
    """Record, at every send, how many messages the step then holds (itself included)."""
    from mpar.comm import _p2p

    held: list[int] = []
    add = _p2p.PendingSends.add

    def counting(self: _p2p.PendingSends, *args: object, **kwargs: object) -> None:
        add(self, *args, **kwargs)  # type: ignore[arg-type]
        held.append(len(self.buffers))

    _p2p.PendingSends.add = counting  # type: ignore[method-assign]
    return held


def _body(microbatches: list[int]) -> list[dict[str, float]]:
    """1F1B at p = 2 for each number of microbatches (the same microbatch size): the most
    messages held at a send, and the step's RSS peak above the RSS before it."""
    import mpar

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed tensors leave RSS
    held = _held_sends()
    out = []
    for m in microbatches:
        mpar.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "interleaved"})
        torch.manual_seed(0)
        model = mpar.DistributedModel(nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H)))
        opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

        @mpar.step
        def train(mdl, x):
            loss = mdl(x).square().mean()
            mdl.backward(loss)
            return loss

        x = torch.randn(m * MICROBATCH, SEQ, H)
        train(model, x)  # partitions; its first transfers agree the shapes
        opt.step()
        held.clear()
        with RssPeak() as rss:
            base = rss.peak
            train(model, x)
            opt.step()
            opt.zero_grad()
        out.append({"held": max(held, default=0), "sends": len(held), "peak": rss.peak - base})
        mpar.shutdown()
    return out


def test_a_step_holds_the_messages_in_flight_not_every_one_it_sent():
    from mpar.partition._prediction import message_counts

    results = run_distributed(_body, 2, args=([4, 16],), timeout=240)
    for rank, (few, many) in enumerate(results):
        assert (few["sends"], many["sends"]) == (4, 16)  # one message per microbatch
        # at most the planner's count (1F1B, p = 2: two activations sent on, two gradients
        # back), the same at 16 microbatches as at 4
        bound = message_counts(2, 1, 16, "interleaved")[rank]
        assert many["held"] <= bound.sends_forward + bound.sends_backward, (rank, many)
        assert many["held"] <= few["held"] + 1, (rank, few, many)
        # holding every message would add 12 MiB at 16 microbatches
        assert many["peak"] <= 1.1 * few["peak"] + 4 * MIB, (rank, few, many)
