"""Hangs and mismatches between ranks become errors that name both sides."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import batch, loss_fn, mlp, train_loss


def _mismatched_transfer():
    import torch

    import mpar
    from mpar.comm import state
    from mpar.comm._p2p import PendingSends, recv_payload, send_payload
    from mpar.comm._types import Transfer, TransferLabel
    from mpar.errors import CommError

    def label(j):
        return TransferLabel(Transfer.ACTIVATIONS, 1, j)

    mpar.init({"timeout_s": 30})
    links, pending = state().p2p_links, PendingSends()
    if mpar.rank() == 0:  # microbatches 0 and 1, where rank 1 expects 0 and 2
        for j in (0, 1):
            send_payload((torch.full((3,), float(j)),), 1, label(j), pending, links)
        mpar.barrier()  # (rank 1 stops receiving at the mismatch: the last send stays open)
        return None
    first = recv_payload(0, label(0), torch.device("cpu"), links)
    try:
        recv_payload(0, label(2), torch.device("cpu"), links)
    except CommError as exc:
        mpar.barrier()
        return first[0].tolist(), str(exc)
    return first[0].tolist(), "no error"


@pytest.mark.timeout(60)
def test_a_transfer_for_another_action_names_both_ranks():
    _, (first, message) = run_distributed(_mismatched_transfer, 2, timeout=50)
    assert first == [0.0, 0.0, 0.0]
    assert message.startswith(
        "pipeline transfer mismatch: rank 1 expected activations for 1F2 from rank 0, "
        "but rank 0 sent activations for 1F1; the two ranks run different schedules"
    ), message


def _different_configs():
    import os

    import mpar
    from mpar.errors import ConfigError

    rank = int(os.environ["RANK"])
    try:
        mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2 + 2 * rank})
    except ConfigError as exc:
        return str(exc), mpar.is_initialized()
    return "no error", mpar.is_initialized()


@pytest.mark.timeout(60)
def test_ranks_with_different_configs_are_refused_at_init():
    results = run_distributed(_different_configs, 2, timeout=50)
    for message, initialised in results:
        assert not initialised
        assert "the ranks were started with different configurations" in message, message
        assert "rank 1 has microbatches=4 where rank 0 has 2" in message


def _stuck_in_step(trace, how):
    import os
    import signal

    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 6, "trace": trace})
    model = mpar.DistributedModel(mlp())

    @mpar.step
    def train(m, x, y):
        out = m(x)
        if mpar.rank() == 1 and how == "sleep":
            time.sleep(120)
        if mpar.rank() == 1 and how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # its watchdog cannot answer either
        loss = loss_fn(out, y)
        m.backward(loss)
        return loss

    x, y = batch("mlp", 0)
    train(model, x, y)


@pytest.mark.timeout(90)
def test_a_hang_under_a_plain_master_port_ends_and_writes_the_trace(tmp_path: Path):
    trace = tmp_path / "trace"
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match="died with exit code 1") as info:
        run_distributed(_stuck_in_step, 2, args=(str(trace), "sleep"), timeout=80)
    assert "rank 1 made no progress" in str(info.value)  # the harness shows the report
    assert time.monotonic() - started < 6 + 30
    report = (trace / "hang-report.txt").read_text()
    assert report.startswith("mpar: hang detected (a rank waited more than timeout_s=6 s)")
    assert "rank 1 made no progress" in report and "time.sleep(120)" in report
    flight = json.loads((trace / "rank0.flight.json").read_text())
    assert "waiting" in flight["position"] and "from rank 1" in flight["position"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_that_cannot_answer_is_named_by_the_rank_that_waits(tmp_path: Path):
    trace = tmp_path / "trace"
    with pytest.raises(DistributedTestError, match="rank 0 died with exit code 1"):
        run_distributed(_stuck_in_step, 2, args=(str(trace), "stop"), timeout=80)
    report = (trace / "hang-report.txt").read_text()
    assert "rank 1 made no progress and did not answer; rank 0 waits for it" in report
    assert "rank 1: did not answer (its process may be stopped" in report
    assert "rank 0 (pid" in report and "from rank 1" in report
    assert not (trace / "rank1.flight.json").exists()


def _sleep_before_the_gradient_reduction(trace):
    import mpar

    mpar.init({"microbatches": 2, "timeout_s": 6, "trace": trace, "zero": {"stage": 2}})
    model = mpar.DistributedModel(mlp())

    x, y = batch("mlp", 0)
    train_loss(model, x, y)
    if mpar.rank() == 1:
        time.sleep(120)
    train_loss(model, x, y)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_data_parallel_rank_that_sleeps_between_steps_is_named(tmp_path: Path):
    trace = tmp_path / "trace"
    with pytest.raises(DistributedTestError, match="died with exit code 1"):
        run_distributed(_sleep_before_the_gradient_reduction, 2, args=(str(trace),), timeout=80)
    report = (trace / "hang-report.txt").read_text()
    assert "rank 1 made no progress" in report and "between steps, after step 0" in report
    assert "time.sleep(120)" in report
    assert "rank 0 (pid" in report and "waiting" in report
