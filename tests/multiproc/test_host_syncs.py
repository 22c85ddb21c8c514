"""Host synchronizations per steady-state step, counted by the ledger behind the device
seam (``mpar._device.SYNCS``): every place that makes the host wait for the device
goes through it, and on the CPU the calls are counted all the same."""

from __future__ import annotations

from typing import Any

import pytest

from mpar.runtime._batch_check import FIRST_STEPS
from mpar.testing import run_distributed


def _counts(config: dict[str, Any], steps: int) -> dict[str, int]:
    import mpar
    from mpar import _device
    from tests.multiproc._pipeline_cases import MODELS, batch, loss_fn, make_optimizer

    mpar.init(config)
    model = mpar.DistributedModel(MODELS["mlp"]())
    opt = mpar.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

    @mpar.step
    def train_step(m: Any, x: Any, y: Any) -> Any:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return {"loss": loss}

    counts: dict[str, int] = {}
    for s in range(steps):
        x, y = batch("mlp", s, 16)
        _device.SYNCS.take()
        train_step(model, x, y)
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        counts = _device.SYNCS.take()  # the last step's: the steady state
    mpar.shutdown()
    return counts


CASES = {
    "fp32": ({}, {}),
    "bf16": ({"bf16": True}, {}),
    "fp16": ({"fp16": True}, {"fp16 overflow flag": 1}),
    "offload": ({"zero": {"stage": 2, "offload_optimizer": "cpu"}}, {"offload copies": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_step_waits_for_the_host_a_constant_number_of_times(case):
    """pp=2 at M=4 and M=8, with clipping: the same few waits, whatever M. The last
    stage's rank copies the step's outputs to the host once (not per microbatch); the
    clipping coefficient stays on the device; fp16 reads one overflow flag per step;
    offload waits once, for the gradients the host optimizer reads (the masters'
    copies back to the device are waited for by the next writer of the masters: that
    same wait of the next step)."""
    extra, more = CASES[case]
    by_m = {}
    for m in (4, 8):
        config = {"pipeline_parallel_degree": 2, "microbatches": m, **extra}
        # the step after the batch checks of the first steps (each one host read)
        by_m[m] = run_distributed(_counts, 2, args=(config, FIRST_STEPS + 1), timeout=120)
    first, last = ({**more}, {"step outputs to the host": 1, **more})
    for m, (rank0, rank1) in by_m.items():
        assert rank0 == first and rank1 == last, (m, rank0, rank1)
        assert sum(rank1.values()) <= 4


def _one_rank(steps: int) -> dict[str, Any]:
    import mpar
    from mpar import _device
    from tests.multiproc._pipeline_cases import MODELS, batch, loss_fn, make_optimizer

    mpar.init({"microbatches": 4})
    model = mpar.DistributedModel(MODELS["mlp"]())
    opt = mpar.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

    @mpar.step
    def train_step(m: Any, x: Any, y: Any) -> Any:
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return {"loss": loss}

    outs = []
    for s in range(steps):
        x, y = batch("mlp", s, 16)
        _device.SYNCS.take()
        outs.append(train_step(model, x, y))
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    in_step = _device.SYNCS.take()
    losses = [float(out["loss"].reduce_mean()) for out in outs]  # the user's reads
    read = _device.SYNCS.take()
    on_host = all(t.device.type == "cpu" for t in outs[-1]["loss"].outputs)
    mpar.shutdown()
    return {"in_step": in_step, "read": read, "losses": losses, "on_host": on_host}


def test_one_rank_keeps_the_outputs_on_the_device_until_they_are_read():
    """A job of one rank gathers nothing: the step's outputs stay on the device, the
    steady step waits for nothing, and reading them is one counted wait per step read;
    the values are the single process's."""
    import torch

    from tests.multiproc._pipeline_cases import reference

    steps = FIRST_STEPS + 1
    (r,) = run_distributed(_one_rank, 1, args=(steps,), timeout=120)
    assert r["in_step"] == {} and r["read"] == {"step outputs to the host": steps}
    assert r["on_host"]
    ref = reference("mlp", "sgd", steps, clip=0.5, batch_size=16)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]))
