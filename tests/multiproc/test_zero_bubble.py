"""The zero-bubble schedules (backward split into I and W) are transparent.

Losses, outputs, gradients and parameters after 3 steps equal one-process
training on the whole batch (fp32), for ``zero_bubble`` and ``zbv``, alone,
with virtual stages, with data parallelism, with ZeRO 1-3 (gradients reduced
after the last W), with activation checkpointing, with bf16 (against the
mixed-precision recipe, to bf16's rounding), with the GPT's tied embedding
(the head on another rank, or beside it in the V), and run from a CSV export
of the generated schedule. The split itself is on (the default); one test
runs the opt-out. ``-m slow`` runs the grids: zero_bubble/zbv x pp {2, 4} x
dp {1, 2} x m {4, 8} x ZeRO 0-3 x SGD/AdamW, bf16 with every ZeRO stage,
and a CSV round trip of every generated schedule.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import BATCH, mixed_reference, reference, train_ranks
from tests.multiproc.test_pipeline_transparency import STEPS, TOL, _check


def _run(pp, dp, m, model, optimizer, env=None, **extra):
    config = {"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": "zero_bubble"}
    config.update(extra)
    size = max(BATCH, m * dp)  # dp 2 x m 8 needs 16 samples
    results = run_distributed(
        train_ranks,
        pp * dp,
        args=(config, model, optimizer, STEPS, None, size),
        timeout=240,
        env=env,
    )
    ref = reference(model, optimizer, STEPS, batch_size=size)
    if config.get("zero", {}).get("stage", 0) >= 2:  # gradients are sharded there
        for r in results:
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL
            )
            for name, tensor in ref["state"].items():
                torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)
    else:
        _check(results, ref)
    if not config.get("zero", {}).get("stage", 0):  # ZeRO frees or shards .grad
        got = set().union(*(set(r["grads"][-1]) for r in results))
        assert got == set(ref["grads"][-1]), "parameters without a gradient"


ZBV_CONFIG = {"pipeline": "zbv", "virtual_stages": 2}
DEFAULT = [
    # (pp, dp, m, model, optimizer, extra)
    (2, 1, 4, "gpt", "adamw", {}),
    (4, 1, 8, "mlp", "sgd", {}),
    (2, 2, 4, "gpt", "adamw", {"zero": {"stage": 3}}),
    (2, 1, 8, "gpt", "sgd", {"activation_checkpointing": True, **ZBV_CONFIG}),
]
MORE = [
    (2, 1, 4, "gpt", "sgd", {"virtual_stages": 2}),
    (4, 1, 8, "gpt", "adamw", {"virtual_stages": 2}),
    (2, 2, 3, "mlp", "adamw", {}),
    (2, 2, 4, "gpt", "adamw", {"zero": {"stage": 1}}),
    (2, 1, 4, "gpt", "adamw", {"activation_checkpointing": True}),
    (4, 1, 8, "gpt", "sgd", {"activation_checkpointing": True}),
    (2, 2, 4, "gpt", "sgd", {"activation_checkpointing": True, "zero": {"stage": 3}}),
    (2, 1, 4, "gpt", "adamw", {"activation_checkpointing": True, **ZBV_CONFIG}),
    (4, 1, 8, "gpt", "sgd", {"activation_checkpointing": True, **ZBV_CONFIG}),
    (2, 2, 8, "gpt", "sgd", {"zero": {"stage": 2}, "virtual_stages": 2}),
]


@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), DEFAULT)
def test_zero_bubble_is_transparent(pp, dp, m, model, optimizer, extra):
    _run(pp, dp, m, model, optimizer, **extra)


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), MORE)
def test_zero_bubble_is_transparent_more(pp, dp, m, model, optimizer, extra):
    _run(pp, dp, m, model, optimizer, **extra)


PIPELINES = {"zero_bubble": {}, "zbv": ZBV_CONFIG}
"""Config keys of each zero-bubble schedule (zbv needs two chunks per rank)."""

GRID = [
    (pipeline, pp, dp, m, zero, optimizer)
    for pipeline, pp, dp, m, zero, optimizer in itertools.product(
        PIPELINES, [2, 4], [1, 2], [4, 8], [0, 1, 2, 3], ["sgd", "adamw"]
    )
    if pp * dp <= 4 and (zero == 0 or dp > 1)
]


@pytest.mark.slow
@pytest.mark.parametrize(("pipeline", "pp", "dp", "m", "zero", "optimizer"), GRID)
def test_zero_bubble_full_grid(pipeline, pp, dp, m, zero, optimizer):
    _run(pp, dp, m, "gpt", optimizer, zero={"stage": zero}, **PIPELINES[pipeline])


def _from_csv(tmp_path, pipeline, pp, m, optimizer):
    from mpar.schedule import build_schedule, write_csv

    v = PIPELINES[pipeline].get("virtual_stages", 1)
    path = tmp_path / f"{pipeline}.csv"
    write_csv(build_schedule(pipeline, pp, m, virtual_stages=v), path)
    config = {"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": str(path)}
    config["virtual_stages"] = v
    results = run_distributed(train_ranks, pp, args=(config, "gpt", optimizer, STEPS), timeout=240)
    _check(results, reference("gpt", optimizer, STEPS))


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_a_schedule_read_from_csv_runs_as_generated(tmp_path, pipeline):
    _from_csv(tmp_path, pipeline, 2, 4, "adamw")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pipeline", "pp", "m", "optimizer"),
    list(itertools.product(PIPELINES, [2, 4], [4, 8], ["sgd", "adamw"])),
)
def test_every_generated_schedule_runs_from_its_csv(tmp_path, pipeline, pp, m, optimizer):
    _from_csv(tmp_path, pipeline, pp, m, optimizer)


def _reordered_transfers(schedule, moves=20, seed=0):
    """``schedule`` with its SEND/RECV actions moved by random adjacent swaps that keep
    it valid and deadlock-free (the compute order stays; where transfers run changes)."""
    import dataclasses
    import random

    from mpar.errors import ScheduleError
    from mpar.schedule import COMMUNICATION_KINDS, simulate

    rng, done = random.Random(seed), 0
    for _ in range(5000):
        if done == moves:
            break
        r = rng.choice(sorted(schedule.actions))
        row = list(schedule.actions[r])
        i = rng.choice([i for i, a in enumerate(row) if a.kind in COMMUNICATION_KINDS])
        k = i + rng.choice((-1, 1))
        if not 0 <= k < len(row):
            continue
        row[i], row[k] = row[k], row[i]
        candidate = dataclasses.replace(schedule, actions={**schedule.actions, r: row})
        try:
            simulate(candidate)  # validates, and raises on deadlock
        except ScheduleError:
            continue
        schedule, done = candidate, done + 1
    return schedule


@pytest.mark.parametrize(("pipeline", "pp", "m"), [("zero_bubble", 2, 4), ("zbv", 2, 4)])
def test_the_runtime_executes_the_transfers_where_the_schedule_puts_them(tmp_path, pipeline, pp, m):
    """A CSV with its own SEND/RECV order runs as written: every rank's timeline is
    its row of the file, action for action, and training stays transparent."""
    import json

    from mpar.schedule import executable_schedule, read_csv, write_csv

    v = PIPELINES[pipeline].get("virtual_stages", 1)
    generated = executable_schedule(pipeline, pp, m, virtual_stages=v)
    schedule = _reordered_transfers(generated)
    assert schedule.actions != generated.actions
    path = tmp_path / "reordered.csv"
    write_csv(schedule, path, communication=True)
    assert read_csv(path).actions == schedule.actions
    trace = tmp_path / "trace"
    config = {
        "pipeline_parallel_degree": pp,
        "microbatches": m,
        "pipeline": str(path),
        "virtual_stages": v,
        "trace": str(trace),
    }
    results = run_distributed(train_ranks, pp, args=(config, "gpt", "adamw", STEPS), timeout=240)
    _check(results, reference("gpt", "adamw", STEPS))
    for rank in range(pp):
        recorded = json.loads((trace / f"rank{rank}.timeline.json").read_text())
        executed = [a for a in recorded["schedule"]["actions"][str(rank)]]
        # the file's transfers in the file's order (the GPT's tied weights add the
        # REDUCE_GRAD of the sharding lowering)
        assert [a for a in executed if "REDUCE_GRAD" not in a] == [
            str(a) for a in schedule.actions[rank]
        ]
        for step in recorded["steps"]:
            assert [a[0] for a in step["actions"]] == executed


def _check_chrome_trace_events(events):
    """What Perfetto's (and chrome://tracing's) JSON importer needs of each event."""
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and "name" in e["args"], e
            continue
        assert isinstance(e["name"], str) and isinstance(e["ts"], int | float), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0, e
        else:
            assert e["s"] in ("g", "p", "t"), e


def test_trace_of_a_real_run_merges_beside_the_simulation(tmp_path, capsys):
    import json

    from mpar.cli import main
    from mpar.schedule import executable_schedule

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
    _check_chrome_trace_events(events)
    measured = {(e["tid"], e["name"]) for e in events if e["pid"] == 0 and e.get("ph") == "X"}
    assert {name for tid, name in measured if tid == 0} >= {"0F0", "0I3", "0W3"}
    assert {name for tid, name in measured if tid == 1} >= {"1F0", "1I3", "1W3"}
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert threads.get(0) == "rank 0" and threads.get(1) == "rank 1"
    for rank in (0, 1):  # the split is on: W is real work on both ranks
        mine = [e for e in events if e["pid"] == 0 and e.get("tid") == rank]
        w = [e["dur"] for e in mine if e.get("cat") == "W"]
        assert len(w) == 4 and sum(w) > 0
    assert any(e["pid"] == 1 and e.get("ph") == "X" for e in events)  # the simulated track
    assert main(["schedule", "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured_step_s"] > 0 and len(report["measured_bubble"]) == 2
    # the runtime's own cost is its own category: per kind in the report, slices in the trace
    overhead = report["overhead_us_per_action"]
    assert {"F", "I", "W", "SEND_F", "RECV_F"} <= set(overhead)
    assert overhead["F"]["actions"] == 8 and overhead["SEND_F"]["median_us"] > 0
    assert any(e.get("cat") == "overhead" for e in events)
    for e in (e for e in events if e["pid"] == 0 and e.get("cat") == "F"):
        assert 0 <= e["args"]["overhead_us"] <= e["dur"] and e["args"]["compute_us"] > 0
    # one object: what mpar schedule prints, what was simulated beside the measurement
    # and what each rank executed (the GPT's cross-rank tie brings ZeRO-0's buckets)
    printed = executable_schedule("zero_bubble", 2, 4, zero_stage=0)
    for rank in (0, 1):
        recorded = json.loads((trace / f"rank{rank}.timeline.json").read_text())
        assert recorded["schedule"] == printed.to_dict()
        executed = [a[0] for a in recorded["steps"][-1]["actions"]]
        assert executed == [str(a) for a in printed.actions[rank]]
        assert f"{rank}{'SEND' if rank == 0 else 'RECV'}_F0" in executed


ZBV = [
    (2, 1, 4, "gpt", "adamw", {}),
    (4, 1, 8, "gpt", "sgd", {}),
    (2, 2, 4, "gpt", "adamw", {"zero": {"stage": 3}}),
]


@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), ZBV)
def test_zbv_v_placement_is_transparent(pp, dp, m, model, optimizer, extra):
    _run(pp, dp, m, model, optimizer, pipeline="zbv", virtual_stages=2, **extra)


UNDER_RULES = [
    (2, 1, 4, "mlp", "adamw", {}),
    pytest.param(2, 1, 4, "gpt", "adamw", {}, marks=pytest.mark.slow),
    pytest.param(2, 1, 4, "gpt", "adamw", ZBV_CONFIG, marks=pytest.mark.slow),
    pytest.param(2, 2, 4, "gpt", "sgd", {"virtual_stages": 2}, marks=pytest.mark.slow),
    pytest.param(4, 1, 8, "mlp", "sgd", ZBV_CONFIG, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("pp", "dp", "m", "model", "optimizer", "extra"), UNDER_RULES)
def test_zero_bubble_is_transparent_under_nccl_rules(pp, dp, m, model, optimizer, extra):
    """Transfers through the transport that enforces NCCL's rules (``nccl_rules``)."""
    _run(pp, dp, m, model, optimizer, nccl_rules=True, **extra)


WHOLE = {"MPAR_SPLIT_BACKWARD": "0"}  # the opt-out: I runs the whole backward, W nothing


def test_split_backward_with_one_unit_per_stage_and_tied_embeddings():
    # One unit per stage: a stage holds only ``wpe`` and returns wpe(arange(T))
    # (an output made from its weight alone) beside the carried embedding; the
    # head on another rank is tied to wte. wpe's gradient used to be lost by the
    # split (losses equal in step 1, different from step 2 on).
    _run(4, 1, 4, "gpt", "sgd", virtual_stages=2)


def test_the_opt_out_runs_the_whole_backward_in_I():
    _run(2, 1, 4, "gpt", "adamw", env=WHOLE)


# -- mixed precision ------------------------------------------------------------


def _run_bf16(pipeline, pp, dp, m, zero):
    """bf16 against the mixed-precision recipe in plain torch (SGD, clipped), to
    bf16's rounding: microbatch gradients are summed in bf16 in another order."""
    from tests.multiproc.test_mixed_precision import LOSS_TOL, SUMMED
    from tests.multiproc.test_mixed_precision import _check as check_mixed

    config = {"pipeline_parallel_degree": pp, "microbatches": m, "bf16": True}
    config.update(PIPELINES[pipeline], zero={"stage": zero})
    results = run_distributed(
        train_ranks, pp * dp, args=(config, "gpt", "sgd", STEPS, 0.5), timeout=240
    )
    ref = mixed_reference("gpt", "sgd", STEPS, torch.bfloat16, clip=0.5)
    check_mixed(results, ref, "bf16", SUMMED["bf16"], LOSS_TOL["bf16"])


BF16 = [
    pytest.param(pipeline, pp, dp, m, zero, marks=marks)
    for pipeline, pp, dp, m, zero, marks in [
        ("zero_bubble", 2, 1, 4, 0, ()),
        ("zbv", 2, 2, 4, 2, ()),
    ]
    + [
        (pipeline, 2, 2, 4, zero, (pytest.mark.slow,))
        for pipeline in PIPELINES
        for zero in [0, 1, 2, 3]
        if (pipeline, zero) != ("zbv", 2)
    ]
    + [(pipeline, 4, 1, 8, 0, (pytest.mark.slow,)) for pipeline in PIPELINES]
]


@pytest.mark.parametrize(("pipeline", "pp", "dp", "m", "zero"), BF16)
def test_bf16_follows_the_mixed_precision_recipe(pipeline, pp, dp, m, zero):
    _run_bf16(pipeline, pp, dp, m, zero)


@pytest.mark.timeout(300)
def test_a_placement_from_stage_costs_with_an_allowance_is_transparent(tmp_path):
    """zero_bubble placed with unequal stage costs and room for 3 microbatches (an order
    the unit costs never give: each rank runs a third forward before a W) trains as one
    process does, run from its CSV."""
    from mpar.schedule import StageCosts, peak_in_flight, write_csv, zero_bubble

    costs = StageCosts([7.4, 9.0], [14.0, 16.1], 0.5, [0.0, 9.5], [14.0, 6.6])
    schedule = zero_bubble(2, 2, 4, active_microbatches=3, costs=costs)
    assert schedule.actions != zero_bubble(2, 2, 4).actions
    assert max(peak_in_flight(schedule)) == 3
    path = tmp_path / "placed.csv"
    write_csv(schedule, path)
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": str(path)}
    results = run_distributed(train_ranks, 2, args=(config, "gpt", "adamw", STEPS), timeout=240)
    _check(results, reference("gpt", "adamw", STEPS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 3])
def test_zero_bubble_with_an_allowance_is_placed_from_measured_times(zero):
    """active_microbatches above ZB-H1's 2: steps 3 to 5 are timed, every rank switches
    to the placement from the gathered times at the sixth, and training stays exact."""
    from mpar.schedule import lower, peak_in_flight, zero_bubble

    steps = 7
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zero_bubble",
              "active_microbatches": 3, "zero": {"stage": zero}}  # fmt: skip
    dp = 2 if zero else 1
    results = run_distributed(
        train_ranks, 2 * dp, args=(config, "gpt", "adamw", steps, None, 8), timeout=240
    )
    ref = reference("gpt", "adamw", steps, batch_size=8)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)
    schedules = [r["schedule"] for r in results]
    assert all(s.actions == schedules[0].actions for s in schedules)  # every rank the same
    costs = results[0]["placement_costs"]
    assert costs is not None and all(r["placement_costs"] == costs for r in results)
    assert all(f > 0 for f in costs.forward) and costs.weight_backward[1] > 0
    expected = lower(zero_bubble(2, 2, 4, active_microbatches=3, costs=costs), zero_stage=zero)
    assert schedules[0].actions == expected.actions
    assert max(peak_in_flight(schedules[0])) <= 3


def _train_with_a_verdict(gain, config, steps):
    """``train_ranks`` with the measured placement made from fixed stage costs (so it is
    never ZB-H1's order) and judged with ``gain``: below -1 it is always kept, above 1
    never (ZB-H1's order again from the thirteenth step)."""
    import mpar.runtime._placement as placement
    from mpar.schedule import StageCosts

    placement._costs = lambda samples, n: StageCosts(
        [7.4, 9.0], [14.0, 16.1], 0.5, [0.0, 9.5], [14.0, 6.6]
    )
    placement._GAIN = gain
    return train_ranks(config, "gpt", "adamw", steps, None, 8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kept", [False, True])
def test_a_placement_that_does_not_run_faster_goes_back_to_zb_h1(kept):
    """Steps 7 to 12 alternate ZB-H1's order and the placed one; unless the placed one
    ran faster, every rank returns to ZB-H1's order at the thirteenth step; training
    stays exact through every switch."""
    from mpar.schedule import lower, zero_bubble

    steps = 14
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zero_bubble",
              "active_microbatches": 3}  # fmt: skip
    results = run_distributed(
        _train_with_a_verdict, 2, args=(-10.0 if kept else 10.0, config, steps), timeout=240
    )
    ref = reference("gpt", "adamw", steps, batch_size=8)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)
        assert r["placement_kept"] is kept
        assert len(r["placement_ratios"]) == 3 and all(t > 0 for t in r["placement_ratios"])
    costs = results[0]["placement_costs"]
    placed = lower(zero_bubble(2, 2, 4, active_microbatches=3, costs=costs), zero_stage=0)
    unit = lower(zero_bubble(2, 2, 4, active_microbatches=3), zero_stage=0)
    assert placed.actions != unit.actions
    for r in results:
        assert r["schedule"].actions == (placed if kept else unit).actions
