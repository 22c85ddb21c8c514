"""The auto-planner (``mpar.partition.search``), its memory model, and ``mpar plan --auto``."""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter

import pytest

from mpar.config import config_from_dict, load_config
from mpar.errors import PartitionError
from mpar.partition import (
    CostModel,
    MemoryLayout,
    PlanInputs,
    SearchSpace,
    make_plan,
    plan_inputs,
    search,
)
from mpar.partition._memory_model import (
    MessageCounts,
    loss_bytes,
    stage_extra_bytes,
    transfer_bytes,
    unit_state_bytes,
    working_set_for_solver,
    zero_working_set_bytes,
)
from mpar.profile import ModelProfile, UnitProfile

MiB = 2**20


def _run(pp: int = 1, *, world: int | None = None, **config: object) -> PlanInputs:
    """The planner's inputs for these config keys on ``world`` ranks (default ``pp``)."""
    cfg = config_from_dict({"pipeline_parallel_degree": pp, **config})
    return plan_inputs(cfg, world or pp, device="cuda")


def _unit(i, *, params=4 * MiB, act=8 * MiB, out=MiB, time=1e-3):
    return UnitProfile(
        name=f"u{i}",
        param_count=params // 4,
        param_bytes=params,
        grad_bytes=params,
        optimizer_bytes=2 * params,
        flops=0,
        time_s=time,
        activation_bytes=act,
        output_bytes=out,
    )


def _profile(n=8, **kw):
    units = [_unit(i, **kw) for i in range(n)]
    return ModelProfile(units, "measure", "adam", sum(u.param_count for u in units))


def test_unit_state_follows_zero_precision_and_offload():
    u = _unit(0, params=400)  # P = G = 400, adam O = 800
    assert unit_state_bytes(u, MemoryLayout()) == 400 + 400 + 800
    assert unit_state_bytes(u, MemoryLayout(4, 1)) == 400 + 400 + 800 / 4
    # ZeRO-2: gradients reduce-scattered per unit as produced, only the shard stays
    assert unit_state_bytes(u, MemoryLayout(4, 2)) == 400 + 100 + 800 / 4
    # ZeRO-3: this rank's parameter shard (the gathered units are the stage's working set)
    assert unit_state_bytes(u, MemoryLayout(4, 3)) == 100 + 100 + 200
    # parameter offload takes the optimizer to the host with it (as the runtime does)
    assert unit_state_bytes(u, MemoryLayout(4, 3, offload_params=True)) == 0 + 100
    assert unit_state_bytes(u, MemoryLayout(4, 1, offload_optimizer=True)) == 400 + 400
    # bf16: half-size parameters, fp32 gradients (grad_reduce_dtype's default) and master
    # copy, the master sharded with the optimizer
    assert unit_state_bytes(u, MemoryLayout(4, 1, "bf16")) == 200 + 400 + (800 + 400) / 4
    # ... half-size gradients when they reduce in bf16
    bf16_grads = MemoryLayout(4, 1, "bf16", low_precision_grads=True)
    assert unit_state_bytes(u, bf16_grads) == 200 + 200 + (800 + 400) / 4
    with pytest.raises(PartitionError, match="offload_params needs zero_stage 3"):
        MemoryLayout(2, 1, offload_params=True)
    with pytest.raises(PartitionError, match="precision"):
        MemoryLayout(precision="int8")


def test_zero_working_set_is_two_gathered_units_and_one_gradient_bucket():
    units = [_unit(i, params=p) for i, p in enumerate((100, 400, 300, 200))]
    assert zero_working_set_bytes(units, MemoryLayout(4, 1)) == 0  # full gradient buffer in state
    # the largest unit's gradients twice: autograd's and the flat reduction buffer
    assert zero_working_set_bytes(units, MemoryLayout(4, 2)) == 2 * 400
    # ZeRO-3: a unit and its larger neighbour gathered, with its gradients twice
    assert zero_working_set_bytes(units, MemoryLayout(4, 3)) == 2 * 400 + (400 + 300)
    # bf16: autograd's gradients in bf16, the flat buffer in fp32 (grad_reduce_dtype's
    # default), the gathered parameters in bf16; all bf16 with low-precision gradients
    assert zero_working_set_bytes(units, MemoryLayout(4, 3, "bf16")) == 600 + 700 / 2
    low = MemoryLayout(4, 3, "bf16", low_precision_grads=True)
    assert zero_working_set_bytes(units, low) == (800 + 700) / 2
    # one rank, parameters on the host: still gathered onto the device, no reduction
    assert zero_working_set_bytes(units, MemoryLayout(1, 3, offload_params=True)) == 700
    # neighbours, not the two largest anywhere: the 400 and 300 units are apart here
    apart = [_unit(i, params=p) for i, p in enumerate((400, 100, 100, 300))]
    assert zero_working_set_bytes(apart, MemoryLayout(4, 3)) == 2 * 400 + (400 + 100)


def test_zero_working_set_counts_the_prefetch_budget_and_reducing_once_a_step():
    units = [_unit(i, params=p) for i, p in enumerate((100, 400, 300, 200))]
    # zero.prefetch 2: the unit and its two next (or previous) neighbours gathered
    two = MemoryLayout(4, 3, prefetch=2)
    assert zero_working_set_bytes(units, two) == 2 * 400 + (400 + 300 + 200)
    assert zero_working_set_bytes(units, MemoryLayout(4, 3, prefetch=0)) == 2 * 400 + 400
    # zero.reduce "step": every unit's gradients in the flat buffer for the step; at
    # ZeRO-3 one unit's .grad on top while it folds in, at ZeRO-2 (fp32) none
    step3 = MemoryLayout(4, 3, reduce="step")
    assert zero_working_set_bytes(units, step3) == 1000 + 400 + (400 + 300)
    assert zero_working_set_bytes(units, MemoryLayout(4, 2, reduce="step")) == 1000
    per_unit, reserve = working_set_for_solver(units, step3)
    assert per_unit == [100, 400, 300, 200] and reserve == 400 + (400 + 300)
    with pytest.raises(PartitionError, match="reduce"):
        MemoryLayout(4, 3, reduce="sometimes")
    with pytest.raises(PartitionError, match="prefetch"):
        MemoryLayout(4, 3, prefetch=-1)


def test_last_stage_holds_the_loss_and_checkpointing_keeps_boundaries():
    units = [_unit(i, out=100, act=1000) for i in range(4)]
    plain = MemoryLayout()
    # saved log-probabilities per microbatch in flight + their gradient + the logits' one,
    # all fp32 in every precision (the fp32 cast of the logits lives only in the forward)
    assert loss_bytes(units[-1], plain, in_flight=3) == 100 * 5
    assert loss_bytes(units[-1], MemoryLayout(precision="bf16"), in_flight=3) == 100 * 5
    # a middle stage: output kept per microbatch in flight + one send and one receive each way
    assert stage_extra_bytes(units, 1, 3, 2, plain) == 100 * 2 + 4 * 100
    ckpt = MemoryLayout(activation_checkpointing=True)
    assert stage_extra_bytes(units, 1, 3, 2, ckpt) == (100 + 100) * 2 + 4 * 100
    # held sends counted from the schedule: 3 activations and 1 gradient sent, 2 posted receives
    moved = MessageCounts(3, 1, 1, 1)
    assert transfer_bytes(100, 100, moved) == 6 * 100
    assert stage_extra_bytes(units, 1, 3, 2, plain, moved) == 100 * 2 + 6 * 100
    # the last stage keeps no output (the loss holds the log-probabilities) and sends none
    last = stage_extra_bytes(units, 2, 4, 1, plain, MessageCounts(0, 1, 1, 0))
    assert last == 100 + 100 + loss_bytes(units[-1], plain, 1)


def test_held_messages_follow_the_schedule():
    from mpar.partition._prediction import message_counts as _transfers

    # 1F1B, 4 ranks, 4 microbatches: rank 1 runs F0 F1 F2 B0 F3 B1 B2 B3; its peak of 3 in
    # flight is last reached after F3: the activations of microbatches 1-3 (in flight) may
    # still be on their way, and the one gradient sent (B0's)
    got = _transfers(4, 1, 4, "interleaved")
    assert got[0] == MessageCounts(4, 0, 0, 1)
    assert got[1] == MessageCounts(3, 1, 1, 1)
    # the last rank runs F0 B0 F1 B1 ...: its peak of 1 is last reached after F3, three
    # gradients sent, at most two of them not yet taken (stage 2 holds 2 in flight)
    assert got[3] == MessageCounts(0, 2, 1, 0)
    # GPipe: the peak is after all forwards, before any gradient is sent
    assert _transfers(4, 1, 4, "simple")[1] == MessageCounts(4, 0, 1, 1)


def test_held_messages_do_not_grow_with_the_microbatches():
    """Sends are held until taken (issue 44): bounded by the microbatches in flight, so
    the same at 8 and 512 microbatches, for 1F1B, interleaved and zero-bubble schedules."""
    from mpar.partition._prediction import message_counts as _transfers

    for p, v, pipeline in [(2, 1, "interleaved"), (8, 1, "interleaved"), (4, 2, "interleaved"),
                           (4, 1, "zero_bubble")]:  # fmt: skip
        few, many = _transfers(p, v, 8 * p, pipeline), _transfers(p, v, 512, pipeline)
        assert few == many, (p, v, pipeline)
    assert _transfers(8, 1, 512, "interleaved")[0] == MessageCounts(8, 0, 0, 1)


def test_make_plan_checkpointing_trades_memory_for_time():
    prof = _profile(8, act=64 * MiB)
    plain = make_plan(prof, _run(2, microbatches=8, memory_weight=0.0))
    ckpt = make_plan(
        prof, _run(2, microbatches=8, memory_weight=0.0, activation_checkpointing=True)
    )
    assert ckpt.stages[0].activation_bytes == plain.stages[0].activation_bytes // 2  # 2 in flight
    assert max(ckpt.rank_memory_bytes) < max(plain.rank_memory_bytes)
    assert ckpt.step_time_s > plain.step_time_s
    assert plain.stages[-1].extra_bytes > loss_bytes(prof.units[-1], MemoryLayout(), 1)  # the loss
    half = make_plan(prof, _run(2, microbatches=8, memory_weight=0.0), microbatch_scale=0.5)
    assert half.stages[0].activation_bytes == plain.stages[0].activation_bytes // 2
    assert half.step_time_s == pytest.approx(plain.step_time_s / 2, rel=0.01)


def test_make_plan_adds_data_parallel_sync_to_the_step():
    prof = _profile(4, params=400 * MiB)
    one = make_plan(prof, _run(2, microbatches=4))
    four = make_plan(prof, _run(2, world=8, microbatches=4), cost=CostModel(dp_bandwidth=1e9))
    assert one.overhead_s == 0.0
    # a ring all-reduce moves 2 (dp-1)/dp of the rank's 800 MiB of gradients at 1 GB/s
    assert four.overhead_s == pytest.approx(2 * 0.75 * 800 * MiB / 1e9)
    assert four.step_time_s == pytest.approx(one.step_time_s + four.overhead_s)
    # ZeRO-3 (unit-granular): parameters gathered for every forward and every backward
    # of each of the 4 microbatches; gradients reduce-scattered after each microbatch
    # (zero.reduce "microbatch", the default) or once a step ("step")
    cost = CostModel(dp_bandwidth=1e9)
    z3 = make_plan(prof, _run(2, world=8, microbatches=4, zero={"stage": 3}), cost=cost)
    assert z3.overhead_s == pytest.approx(0.75 * (4 * 800 + 2 * 4 * 800) * MiB / 1e9)
    once = _run(2, world=8, microbatches=4, zero={"stage": 3, "reduce": "step"})
    assert make_plan(prof, once, cost=cost).overhead_s == pytest.approx(
        0.75 * (800 + 2 * 4 * 800) * MiB / 1e9
    )


def test_search_ranks_fitting_layouts_fastest_first():
    prof = _profile(8)
    result = search(prof, _run(world=4, device_memory="1GiB"), global_batch=8)
    assert result.ranked and result.fitting >= len(result.ranked)
    times = [c.step_time_s for c in result.ranked]
    assert times == sorted(times)
    for c in result.ranked:
        assert c.max_rank_memory_bytes <= 2**30
        assert c.microbatches * c.microbatch_size * c.data_parallel_degree == 8
        assert c.pipeline_parallel_degree * c.data_parallel_degree == 4
    assert sum(result.rejected.values()) + result.fitting >= result.evaluated
    text = str(result)
    assert "rejected:" in text and "step ms" in text


def test_search_turns_on_checkpointing_only_when_memory_needs_it():
    prof = _profile(8, act=256 * MiB)
    space = SearchSpace(precisions=("fp32",), offload=False)
    roomy = search(prof, _run(world=2, device_memory="64GiB"), global_batch=8, space=space)
    assert not roomy.best.activation_checkpointing
    tight_run = _run(world=2, device_memory="1200MiB")  # at the edge: no headroom
    tight = search(prof, tight_run, global_batch=8, space=space, headroom=0.0)
    assert tight.best.activation_checkpointing
    assert tight.rejected["over memory cap"] > 0
    assert tight.best.step_time_s > roomy.best.step_time_s


def test_search_pruning_matches_exhaustive_ranking():
    prof = _profile(8, act=32 * MiB)
    base = _run(world=4, device_memory="2GiB")
    pruned = search(prof, base, global_batch=16, top=3)
    everything = search(prof, base, global_batch=16, top=10_000)
    assert "slower than the top candidates by their work alone (not laid out)" in pruned.rejected
    assert pruned.evaluated < everything.evaluated  # the rest could not enter the top 3
    assert [c.to_dict() for c in pruned.ranked] == [c.to_dict() for c in everything.ranked[:3]]


def test_search_lays_out_in_work_order_and_stops_at_the_top():
    """Each layout's work bound is below its simulated step time, so layouts are laid out
    cheapest bound first and the search stops once no bound can enter the top."""
    prof = _profile(8, act=32 * MiB)
    base = _run(world=8, device_memory="4GiB")
    everything = search(prof, base, global_batch=32, top=10_000)
    for c in everything.ranked:
        m, pp = c.microbatches, c.pipeline_parallel_degree
        work = m * sum(u.time_s for u in prof.units) * c.microbatch_size / pp
        work *= (4 / 3 if c.activation_checkpointing else 1) / (2 if c.precision != "fp32" else 1)
        assert work <= (c.step_time_s or 0) * (1 + 1e-9)
    pruned = search(prof, base, global_batch=32, top=1)
    assert pruned.best.to_dict() == everything.best.to_dict()
    assert pruned.evaluated < everything.evaluated / 2


def test_search_rejects_indivisible_batches_and_reports_nothing_fits():
    prof = _profile(8)
    result = search(prof, _run(world=4, device_memory="4GiB"), global_batch=6)
    assert result.rejected["global batch not divisible by the data-parallel degree"] == 1  # dp=4
    assert {c.data_parallel_degree for c in result.ranked} <= {1, 2}
    nothing = search(prof, _run(world=2, device_memory="1MiB"), global_batch=2)
    assert nothing.ranked == []
    with pytest.raises(PartitionError, match="no layout of 2 ranks fits"):
        nothing.best  # noqa: B018
    with pytest.raises(PartitionError, match="global_batch"):
        search(prof, _run(world=2, device_memory="1GiB"), global_batch=0)


def test_search_best_config_loads_and_matches_make_plan():
    prof = _profile(8)
    result = search(prof, _run(world=4, device_memory="1GiB"), global_batch=8)
    best = result.best
    config = load_config(best.config())
    config.check_world_size(4)
    assert config.pipeline_parallel_degree == best.pipeline_parallel_degree
    assert config.microbatches == best.microbatches and config.zero.stage == best.zero_stage
    # the config it prints is the run it planned: the one translation gives it back
    assert plan_inputs(config, 4, device="cuda") == best.inputs
    plan = make_plan(prof, best.inputs, microbatch_scale=best.microbatch_size)
    assert plan.step_time_s == pytest.approx(best.step_time_s)
    assert max(plan.rank_memory_bytes) == best.max_rank_memory_bytes
    data = result.to_dict()
    assert data["config"]["device_memory"] == int(2**30 * 0.9)  # less the headroom
    assert data["predicted"]["step_time_s"] == best.step_time_s


def _factory(tmp_path, monkeypatch):
    (tmp_path / "auto_factory_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            from mpar.testing.models import GPTConfig, TinyGPT

            def make():
                return TinyGPT(GPTConfig(num_layers=2)), torch.zeros(2, 8, dtype=torch.long)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_cli_plan_auto_json_and_errors(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    _factory(tmp_path, monkeypatch)
    argv = ["plan", "--auto", "--model", "auto_factory_mod:make", "--meta", "--world-size", "4"]
    assert main([*argv, "--device-memory", "256MiB", "--global-batch", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"config", "predicted", "candidates", "rejected", "plan"}
    config = load_config(data["config"])
    config.check_world_size(4)
    assert data["predicted"]["max_rank_memory_bytes"] <= 256 * MiB
    assert data["plan"]["step_time_s"] == pytest.approx(data["predicted"]["step_time_s"])
    # profiled at the example's 2 samples: microbatch sizes are scaled from there
    assert data["candidates"][0]["microbatch_size"] * data["config"]["microbatches"] in (2, 4, 8)
    assert main([*argv, "--device-memory", "256MiB", "--global-batch", "8", "--no-bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16" not in out.split("rejected:")[0].split("precision")[1]
    assert main([*argv, "--device-memory", "256MiB"]) == 2
    assert "--global-batch" in capsys.readouterr().err
    assert main([*argv, "--device-memory", "1KiB", "--global-batch", "8"]) == 2
    assert "no layout of 4 ranks fits" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "auto_factory_mod", raising=False)


def test_cli_plan_reads_knobs_and_refuses_auto_values(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    _factory(tmp_path, monkeypatch)
    model = ["plan", "--model", "auto_factory_mod:make", "--meta", "--world-size", "2", "--json"]
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"partitions": 2, "activation_checkpointing": True}))
    assert main([*model, "--config", str(cfg)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["activation_checkpointing"] is True
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"microbatches": "auto", "device_memory": "1GiB"}))
    assert main([*model, "--config", str(auto)]) == 2
    assert "mpar plan --auto" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "auto_factory_mod", raising=False)


def test_fit_fixed_times_scales_only_the_per_sample_part():
    import dataclasses

    from mpar.partition import fit_fixed_times

    at2 = _profile(4, time=3e-3)  # measured at 2 samples
    at1 = _profile(4, time=2e-3)  # measured at 1 sample
    fitted = fit_fixed_times(at2, 2, at1, 1)
    assert [u.fixed_time_s for u in fitted.units] == pytest.approx([1e-3] * 4)
    # a 1-sample microbatch from the 2-sample profile: 1 ms fixed + 2 ms * 0.5
    plan = make_plan(fitted, _run(2, memory_weight=0.0), microbatch_scale=0.5)
    assert plan.stages[0].time_s == pytest.approx(2 * 2e-3)
    linear = make_plan(at2, _run(2, memory_weight=0.0), microbatch_scale=0.5)
    assert linear.stages[0].time_s == pytest.approx(2 * 1.5e-3)
    with pytest.raises(PartitionError, match="different batch sizes"):
        fit_fixed_times(at2, 2, at1, 2)
    renamed = dataclasses.replace(at1, units=[dataclasses.replace(at1.units[0], name="x")])
    with pytest.raises(PartitionError):
        fit_fixed_times(at2, 2, renamed, 1)


def test_cli_plan_auto_measured_fits_fixed_times(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    _factory(tmp_path, monkeypatch)
    argv = ["plan", "--auto", "--model", "auto_factory_mod:make", "--world-size", "2"]
    assert main([*argv, "--device-memory", "1GiB", "--global-batch", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    load_config(data["config"]).check_world_size(2)
    assert data["predicted"]["step_time_s"] > 0
    monkeypatch.delitem(sys.modules, "auto_factory_mod", raising=False)


def test_a_plan_that_does_not_fit_says_what_the_cap_reserves():
    """The per-stage cap is the device memory less the process and a reserve; the no-fit
    message says how much of it goes where (issue 44: it said 'a memory cap of 0 B')."""
    prof = _profile(8, out=64 * MiB)
    with pytest.raises(PartitionError) as info:
        make_plan(prof, _run(2, microbatches=128, device_memory="300MiB"))
    text = str(info.value)
    assert "no split into 2 stages fits a memory cap of" in text
    assert "The cap per stage is the device memory 300.00 MiB" in text
    # 1F1B at p = 2: two in flight, so two kept boundaries and 3 messages (stage 0: two
    # activations sent, one gradient receive posted), not 128
    assert "boundary tensors kept for backward (2 x 64.00 MiB) 128.00 MiB" in text
    assert "pipeline messages (3 x 64.00 MiB: sends held until the peer takes them" in text


def test_the_search_composes_no_message_for_the_layouts_it_rejects(monkeypatch):
    """Why a layout does not fit (the solver's no-fit message solves again; the planner
    adds what the cap reserves) is composed only when read: the search rejects
    thousands and reads none (it cost half the search's time for a 70B at 64 ranks)."""
    import mpar.partition._planner as planner
    import mpar.partition._solver as solver

    composed: list[str] = []
    monkeypatch.setattr(solver, "_no_fit_message", lambda *a: composed.append("solver") or "")
    real = planner.reserve_parts
    monkeypatch.setattr(planner, "reserve_parts", lambda *a: composed.append("reserve") or real(*a))
    prof = _profile(8, out=64 * MiB, act=64 * MiB)
    result = search(prof, _run(world=2, device_memory="600MiB"), global_batch=64, headroom=0.0)
    assert result.rejected["over memory cap"] > 0 and composed == []
    with pytest.raises(PartitionError) as info:
        make_plan(prof, _run(2, microbatches=128, device_memory="300MiB"))
    assert composed == [] and "The cap per stage" in str(info.value)
    assert composed == ["reserve", "solver"] or composed == ["solver", "reserve"]


def test_the_search_reuses_each_units_figures_across_layouts(monkeypatch):
    """Each unit's state and working set are computed once per memory layout, and its
    seconds once per microbatch size and precision (``UnitCache``), not once per layout
    laid out: the counts are pinned, and the ranking is the one computed afresh each time."""
    import mpar.partition._planner as planner

    made: Counter[str] = Counter()
    for name in ("static_unit_memory", "_unit_times"):
        real = getattr(planner, name)
        monkeypatch.setattr(planner, name, lambda *a, f=real, n=name: made.update([n]) or f(*a))
    prof = _profile(8, act=32 * MiB)
    base = _run(world=8, device_memory="4GiB")
    cached = search(prof, base, global_batch=32, top=3)
    once = dict(made)
    made.clear()
    monkeypatch.setattr(planner.UnitCache, "get", lambda self, key, make: make())
    afresh = search(prof, base, global_batch=32, top=3)
    assert [c.to_dict() for c in cached.ranked] == [c.to_dict() for c in afresh.ranked]
    # 1442 layouts laid out (the evaluated ones not over the cap before laying out, and the
    # simulated ones again): 288 memory layouts, 6 microbatch sizes and precisions
    assert made == {"static_unit_memory": 1442, "_unit_times": 1442}
    assert once == {"static_unit_memory": 288, "_unit_times": 6}
