"""make_plan, manual placement with mpar.partition(i), find_units and `mpar plan`."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

import mpar.partition
from mpar._size import parse_bandwidth
from mpar.config import config_from_dict
from mpar.errors import PartitionError
from mpar.partition import (
    CostModel,
    Plan,
    PlanInputs,
    find_units,
    make_plan,
    manual_boundaries,
    parse_bytes,
    plan_inputs,
)
from mpar.profile import ModelProfile, UnitProfile


def _run(pp: int = 1, **config: object) -> PlanInputs:
    """The planner's inputs for these config keys on ``pp`` ranks (one pipeline)."""
    return plan_inputs(
        config_from_dict({"pipeline_parallel_degree": pp, **config}), pp, device="cuda"
    )


def _profile(times, state=100, act=10, out=None):
    out = out or [1] * len(times)
    units = [
        UnitProfile(
            name=f"u{i}",
            param_count=state // 16,
            param_bytes=state // 4,
            grad_bytes=state // 4,
            optimizer_bytes=state // 2,
            flops=0,
            time_s=t,
            activation_bytes=act,
            output_bytes=out[i],
        )
        for i, t in enumerate(times)
    ]
    return ModelProfile(units, "measure", "adam", sum(u.param_count for u in units))


def test_plan_balances_time_and_reports_stages():
    prof = _profile([1, 1, 1, 1, 2, 2])
    plan = make_plan(prof, _run(2, microbatches=4, memory_weight=0.0))
    assert isinstance(plan, Plan)
    assert plan.boundaries == [0, 4]
    first, second = plan.stages
    assert first.units == ["u0", "u1", "u2", "u3"] and first.rank == 0
    assert first.time_s == 4 and first.compute_share == pytest.approx(0.5)
    assert first.state_bytes == 400 and first.in_flight == 2 and first.activation_bytes == 80
    assert second.in_flight == 1
    assert plan.binding == "compute"
    # 1F1B, p=2, m=4, equal stages: (m + p - 1) * t = 5 * 4
    assert plan.step_time_s == pytest.approx(20) and plan.bubble == pytest.approx(0.2)
    text = str(plan)
    assert "u0 .. u3 (4)" in text and "bubble" in text
    json.dumps(plan.to_dict())


def test_plan_methods_and_virtual_stages():
    prof = _profile([1, 2, 3, 4, 5, 6, 7, 8])
    uniform = make_plan(prof, _run(2, virtual_stages=2, microbatches=4), method="uniform")
    assert uniform.boundaries == [0, 2, 4, 6]
    assert [s.rank for s in uniform.stages] == [0, 1, 0, 1]
    assert [s.chunk for s in uniform.stages] == [0, 0, 1, 1]
    by_params = make_plan(prof, _run(2), method="parameters")
    assert by_params.boundaries == [0, 4]
    with pytest.raises(PartitionError, match="only 8 units"):
        make_plan(prof, _run(4, virtual_stages=3, microbatches=4))


def test_plan_memory_cap_binds_and_no_fit():
    prof = _profile([1, 1, 1, 10], state=100, act=0)
    free = make_plan(prof, _run(2, memory_weight=0.0))
    assert free.boundaries == [0, 3]
    bare = CostModel(process_bytes=0, pipeline_process_bytes=0)  # bytes, not MiB, here
    capped = make_plan(prof, _run(2, memory_weight=0.0, device_memory=250), cost=bare)
    assert capped.boundaries == [0, 2] and capped.binding == "memory cap"
    with pytest.raises(PartitionError, match="smallest pipeline degree that fits is 4"):
        make_plan(prof, _run(2, device_memory=150), cost=bare)
    # the process's own memory comes off the cap first
    process = CostModel(process_bytes=50, pipeline_process_bytes=50)
    assert make_plan(prof, _run(2, device_memory=350), cost=process).boundaries == [0, 2]
    assert capped.process_bytes == 0 and free.process_bytes == 11 * 2**20
    stage = free.stages[0]  # no activations here: the optimizer update's moment is larger
    assert free.optimizer_step_bytes[0] > stage.memory_bytes - stage.state_bytes
    assert free.rank_memory_bytes[0] == (
        free.process_bytes + stage.state_bytes + free.optimizer_step_bytes[0]
    )


def test_plan_charges_communication_at_the_cut():
    prof = _profile([1, 1, 1, 1], act=0, out=[1, 10**9, 1, 1])
    free = make_plan(prof, _run(2, memory_weight=0.0), cost=CostModel(link_bandwidth=None))
    assert free.boundaries == [0, 2] and free.link_bandwidth is None
    assert [s.comm_s for s in free.stages] == [0.0, 0.0]
    # sending u1's 1 GB output on and its gradient back at 1 GB/s costs 2 s per microbatch
    costly = make_plan(
        prof, _run(2, memory_weight=0.0), cost=CostModel(link_bandwidth=parse_bandwidth("1GB/s"))
    )
    assert costly.boundaries in ([0, 1], [0, 3])
    assert costly.stages[0].comm_s == pytest.approx(2e-9) and costly.stages[1].comm_s == 0.0
    at_u1 = make_plan(prof, _run(2), method="uniform", cost=CostModel(link_bandwidth=1e9))
    assert at_u1.stages[0].comm_s == pytest.approx(2.0)
    assert at_u1.step_time_s > free.step_time_s  # communication is in the simulated step
    assert "comm ms" in str(at_u1) and "links 953.67 MiB/s" in str(at_u1)
    with pytest.raises(PartitionError, match="link_bandwidth"):
        make_plan(prof, _run(2), cost=CostModel(link_bandwidth=0))


def test_parse_bytes():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_parse_bandwidth():
    assert parse_bandwidth("10GB") == parse_bandwidth("10GB/s") == 10e9
    assert parse_bandwidth(" 1GiB/s ") == 2**30 and parse_bandwidth(5e8) == 5e8
    assert parse_bandwidth(None) is None
    with pytest.raises(ValueError, match="--tp-bandwidth must be a positive number"):
        parse_bandwidth("0", "--tp-bandwidth")
    with pytest.raises(ValueError, match="cannot read a memory size"):
        parse_bandwidth("fast")


def test_find_units_patterns():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert find_units(seq) == ["0", "1"]
    from mpar.testing.models import TinyGPT

    assert find_units(TinyGPT()) == [
        "wte",
        "wpe",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "ln_f",
        "head",
    ]
    assert find_units(nn.Linear(2, 2)) == [""]


class _Wrapped(nn.Module):
    """A model that keeps its layers in one ``nn.Sequential`` beside a module that never
    runs: one unit at the root, so the wrapper is expanded (two stages can hold it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.net(x)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 1)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def test_find_units_expands_a_lone_wrapper():
    x = torch.randn(3, 4)
    assert find_units(_Wrapped(), (x,)) == ["net.0", "net.1", "net.2"]
    assert find_units(_Wrapped()) == ["net", "unused"]  # without inputs both children count
    single = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert find_units(single) == ["0.0", "0.1"]
    # MultiheadAttention calls no child module: its expansion would leave nothing to cut
    assert find_units(_Attention(), (x,)) == ["attn"]


class _Manual(nn.Module):
    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        with mpar.partition(0):
            self.a = nn.Linear(4, 4)
        with mpar.partition(1):
            self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.act = nn.ReLU()  # not placed: follows the unit before it
        with mpar.partition(0 if swap else 2):
            self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.act(self.b(self.a(x))))


def test_manual_partition_context():
    assert callable(mpar.partition)
    model = _Manual()
    units = find_units(model)
    assert units == ["a", "b", "act", "c"]
    assert manual_boundaries(model, units) == [0, 1, 3]
    assert mpar.partition.assigned_stage(model.b[0]) == 1
    with pytest.raises(PartitionError, match="not contiguous"):
        manual_boundaries(_Manual(swap=True), units)
    # default_partition k > 0 (smp's): unplaced units go to stage k (act: 2, with c);
    # the first unit of a model with nothing placed on stage 0 must still be placed
    assert manual_boundaries(model, units, default=2) == [0, 1, 2]
    with pytest.raises(PartitionError, match="starts on stage 1"):
        manual_boundaries(nn.Sequential(nn.Linear(2, 2)), [""], default=1)
    with pytest.raises(PartitionError):
        mpar.partition(-1).__enter__()


def _write_factory(tmp_path, monkeypatch):
    (tmp_path / "plan_factory_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            from mpar.testing.models import GPTConfig, TinyGPT

            def make():
                return TinyGPT(GPTConfig(num_layers=2)), torch.zeros(2, 8, dtype=torch.long)

            def bare():
                return TinyGPT(GPTConfig(num_layers=2))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"pipeline_parallel_degree": 2, "microbatches": 4}))
    return cfg


def _run_cli(argv):
    import argparse

    from mpar.cli import _plan

    parser = argparse.ArgumentParser()
    _plan.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_cli_plan_json_and_errors(tmp_path, monkeypatch, capsys):
    cfg = _write_factory(tmp_path, monkeypatch)
    common = ["--config", str(cfg), "--world-size", "4"]
    assert _run_cli(["--model", "plan_factory_mod:make", *common, "--meta", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == 2 and data["microbatches"] == 4
    assert _run_cli(["--model", "plan_factory_mod:make", *common, "--meta"]) == 0
    assert "predicted step time" in capsys.readouterr().out
    assert _run_cli(["--model", "plan_factory_mod:bare", *common]) == 2
    assert "example_inputs" in capsys.readouterr().err
    bad = ["--model", "plan_factory_mod:make", *common, "--meta", "--device-memory", "1KiB"]
    assert _run_cli(bad) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no split into 2 stages" in err
    assert _run_cli(["--model", "nope_mod:make", *common]) == 2
    monkeypatch.delitem(sys.modules, "plan_factory_mod", raising=False)


def test_cli_plan_through_main_with_typed_config(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    cfg = _write_factory(tmp_path, monkeypatch)
    model = ["plan", "--model", "plan_factory_mod:make", "--meta", "--json"]
    assert (
        main([*model, "--config", str(cfg), "--world-size", "4", "--link-bandwidth", "none"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["num_ranks"] == 2 and data["microbatches"] == 4 and data["link_bandwidth"] is None
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"partitions": 2, "zero": {"stage": 3}, "optimize": "memory"}))
    assert main([*model, "--config", str(zero), "--world-size", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_weight"] == 0.8 and data["link_bandwidth"] == 1e10
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    assert main([*model, "--world-size", "2"]) == 0  # no config: one pipeline over the world
    assert json.loads(capsys.readouterr().out)["num_ranks"] == 2
    assert main([*model, "--config", str(cfg), "--world-size", "3"]) == 2
    assert "must divide the world size" in capsys.readouterr().err
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"microbatchs": 4}))
    assert main([*model, "--config", str(typo), "--world-size", "1"]) == 2
    assert "microbatches" in capsys.readouterr().err
    # a DeepSpeed JSON: every key it must drop, one a line (only the first line was shown)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 1.0, "bf16": True}))
    assert main([*model, "--config", str(ds), "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "'train_batch_size' (DeepSpeed)" in err and "clip_grad_norm_" in err
    # no config: one stage per rank, more than the model's units: say where that came from
    assert main([*model, "--world-size", "16"]) == 2
    assert "without --config the plan puts one pipeline stage on each" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "plan_factory_mod", raising=False)


def test_plan_prices_the_split_backward_and_says_when_it_does_not_pay():
    from mpar import schedule as sched

    prof = _profile([0.3] + [3.0] * 8 + [2.0])
    plain = make_plan(prof, _run(2, microbatches=4, memory_weight=0.0))
    assert plain.split_backward_gain is None and "split backward" not in str(plain)
    zb = make_plan(prof, _run(2, microbatches=4, pipeline="zero_bubble", memory_weight=0.0))
    # The first stage has no I (its inputs need no gradient): its W is its whole backward.
    fwd = [s.time_s / 3 for s in zb.stages]
    bwd = [2 * s.time_s / 3 for s in zb.stages]
    cost = CostModel()
    ib = [0.0, cost.input_backward_fraction * bwd[1]]
    wb = [bwd[0], cost.weight_backward_fraction * bwd[1] + cost.split_action_s]
    want = sched.simulate(
        sched.build_schedule("zero_bubble", 2, 4),
        sched.StageCosts(fwd, bwd, input_backward=ib, weight_backward=wb),
    ).makespan
    assert zb.step_time_s == pytest.approx(want, rel=1e-6)
    assert zb.split_backward_gain == pytest.approx(plain.step_time_s / zb.step_time_s, rel=1e-3)
    assert zb.split_backward_gain > 1.02 and "does not pay" not in str(zb)
    # A dearer split, or more microbatches (a smaller bubble to fill), and it stops paying.
    dear = CostModel(input_backward_fraction=0.8, weight_backward_fraction=0.6)
    costly = make_plan(
        prof, _run(2, microbatches=4, pipeline="zero_bubble", memory_weight=0.0), cost=dear
    )
    assert costly.split_backward_gain < zb.split_backward_gain
    assert costly.split_backward_gain < 1.0 and "does not pay here" in str(costly)
    many = make_plan(prof, _run(2, microbatches=16, pipeline="zero_bubble", memory_weight=0.0))
    assert many.split_backward_gain < zb.split_backward_gain
    assert "zero_bubble predicted" in str(many)
    json.dumps(zb.to_dict())


def test_cost_model_rejects_negative_split_costs():
    with pytest.raises(PartitionError, match="weight_backward_fraction"):
        CostModel(weight_backward_fraction=-0.1)
