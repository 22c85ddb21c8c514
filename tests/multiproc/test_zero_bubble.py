"""The zero-bubble schedule (backward split into I and W) is transparent.

Losses, outputs, gradients and parameters after 3 steps equal one-process
training on the whole batch (fp32), alone, with virtual stages, with data
parallelism, with ZeRO 1-3 (gradients reduced after the last W), and with
activation checkpointing; ``-m slow`` runs the grid pp {2, 4} x m {4, 8} x
ZeRO 0-3 x SGD/AdamW.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import reference, train_ranks
from tests.multiproc.test_pipeline_transparency import STEPS, TOL, _check


def _run(pp, dp, m, model, optimizer, env=None, **extra):
    config = {"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": "zero_bubble"}
    config.update(extra)
    results = run_distributed(
        train_ranks, pp * dp, args=(config, model, optimizer, STEPS), timeout=240, env=env
    )
    ref = reference(model, optimizer, STEPS)
    if config.get("zero", {}).get("stage", 0) >= 2:  # gradients are sharded there
        for r in results:
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL
            )
            for name, tensor in ref["state"].items():
                torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)
    else:
        _check(results, ref)
        got = set().union(*(set(r["grads"][-1]) for r in results))
        assert got == set(ref["grads"][-1]), "parameters without a gradient"


DEFAULT = [
    # (pp, dp, m, model, optimizer, extra)
    (2, 1, 4, "gpt", "adamw", {}),
    (4, 1, 8, "mlp", "sgd", {}),
    (2, 2, 4, "gpt", "adamw", {"zero": {"stage": 3}}),
]
MORE = [
    (2, 1, 4, "gpt", "sgd", {"virtual_stages": 2}),
    (2, 2, 3, "mlp", "adamw", {}),
    (2, 2, 4, "gpt", "adamw", {"zero": {"stage": 1}}),
    (2, 1, 4, "gpt", "adamw", {"activation_checkpointing": True}),
]


@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), DEFAULT)
def test_zero_bubble_is_transparent(pp, dp, m, model, optimizer, extra):
    _run(pp, dp, m, model, optimizer, **extra)


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), MORE)
def test_zero_bubble_is_transparent_more(pp, dp, m, model, optimizer, extra):
    _run(pp, dp, m, model, optimizer, **extra)


GRID = [
    (pp, dp, m, zero, optimizer)
    for pp, dp, m, zero, optimizer in itertools.product(
        [2, 4], [1, 2], [4, 8], [0, 1, 2, 3], ["sgd", "adamw"]
    )
    if pp * dp <= 4 and (zero == 0 or dp > 1)
]


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "m", "zero", "optimizer"), GRID)
def test_zero_bubble_full_grid(pp, dp, m, zero, optimizer):
    _run(pp, dp, m, "gpt", optimizer, zero={"stage": zero})


@pytest.mark.parametrize("pipeline", ["zero_bubble"])
def test_a_schedule_read_from_csv_runs_as_generated(tmp_path, pipeline):
    from mpar.schedule import build_schedule, write_csv

    path = tmp_path / f"{pipeline}.csv"
    write_csv(build_schedule(pipeline, 2, 4), path)
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": str(path)}
    results = run_distributed(train_ranks, 2, args=(config, "gpt", "adamw", STEPS), timeout=240)
    _check(results, reference("gpt", "adamw", STEPS))


def test_trace_of_a_real_run_merges_beside_the_simulation(tmp_path, capsys):
    import json

    from mpar.cli import main

    trace = tmp_path / "trace"
    config = {
        "pipeline_parallel_degree": 2,
        "microbatches": 4,
        "pipeline": "zero_bubble",
        "trace": str(trace),
    }
    run_distributed(train_ranks, 2, args=(config, "gpt", "sgd", 2), timeout=240)
    assert sorted(p.name for p in trace.glob("rank*.timeline.json")) == [
        "rank0.timeline.json",
        "rank1.timeline.json",
    ]
    assert main(["schedule", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "step 1: measured" in out and "simulated" in out
    events = json.loads((trace / "trace.json").read_text())["traceEvents"]  # Perfetto's format
    measured = {(e["tid"], e["name"]) for e in events if e["pid"] == 0 and e.get("ph") == "X"}
    assert {name for tid, name in measured if tid == 0} >= {"0F0", "0I3", "0W3"}
    assert {name for tid, name in measured if tid == 1} >= {"1F0", "1I3", "1W3"}
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
    assert any(e["pid"] == 1 and e.get("ph") == "X" for e in events)  # the simulated track
    assert main(["schedule", "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured_step_s"] > 0 and len(report["measured_bubble"]) == 2


ZBV = [
    (2, 1, 4, "gpt", "adamw", {}),
    (4, 1, 8, "gpt", "sgd", {}),
    (2, 2, 4, "gpt", "adamw", {"zero": {"stage": 3}}),
]


@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), ZBV)
def test_zbv_v_placement_is_transparent(pp, dp, m, model, optimizer, extra):
    _run(pp, dp, m, model, optimizer, pipeline="zbv", virtual_stages=2, **extra)


WHOLE = {"MPAR_SPLIT_BACKWARD": "0"}  # the opt-out: I runs the whole backward, W nothing


def test_split_backward_with_one_unit_per_stage_and_tied_embeddings():
    # One unit per stage: a stage holds only ``wpe`` and returns wpe(arange(T))
    # (an output made from its weight alone) beside the carried embedding; the
    # head on another rank is tied to wte. wpe's gradient used to be lost by the
    # split (losses equal in step 1, different from step 2 on).
    _run(4, 1, 4, "gpt", "sgd", virtual_stages=2)


def test_the_opt_out_runs_the_whole_backward_in_I():
    _run(2, 1, 4, "gpt", "adamw", env=WHOLE)
