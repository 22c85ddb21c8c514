"""The planner's host memory and microbatch scaling against what runs (issue 27), in one
process: offloaded state counted from the tensors ``ShardedStages`` keeps on the host,
and ``mpar plan --global-batch`` against a profile taken at the size it scales to."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from mpar.config import ZeroConfig, config_from_dict
from mpar.partition import CostModel, MemoryLayout, PlanInputs, make_plan, plan_inputs
from mpar.partition._memory_model import unit_host_bytes, unit_state_bytes
from mpar.profile import profile_model
from mpar.shard import ShardedStages


def _run(pp: int = 1, *, world: int | None = None, device: str = "cpu", **config) -> PlanInputs:
    """The planner's inputs for these config keys on ``world`` ranks (default ``pp``)."""
    cfg = config_from_dict({"pipeline_parallel_degree": pp, **config})
    return plan_inputs(cfg, world or pp, device=device)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 32))


def _host_tensors(sharded, opt):
    """Distinct host storages of offloaded state: optimizer state (the master copy with
    it), the host gradient and, with parameter offload, the parameter shards."""
    tensors = list(opt.state_tensors())
    for b in sharded.buckets:
        tensors += [
            t for t in (b.grads.cpu_grad, b.shard if b.offload_params else None) if t is not None
        ]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for n in seen.values() if n > 8)  # Adam's scalar step counters left out


@pytest.mark.parametrize(
    ("stage", "offload", "dtype"),
    [
        (2, {"offload_optimizer": "cpu"}, None),
        (2, {"offload_optimizer": "cpu"}, torch.bfloat16),
        (3, {"offload_params": "cpu"}, None),
        (3, {"offload_optimizer": "cpu", "offload_params": "cpu"}, torch.bfloat16),
    ],
)
def test_host_bytes_are_what_offload_keeps_on_the_host(stage, offload, dtype):
    x = torch.randn(8, 64)
    profile = profile_model(_model(), (x,), repeats=1, warmup=0)
    model = _model()
    sharded = ShardedStages(
        {0: model},
        ZeroConfig(stage, **offload),
        group=None,
        group_ranks=[0],
        rank_in_group=0,
        device="cpu",
        compute_dtype=dtype,
    )
    opt = sharded.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    for _ in range(2):
        sharded.unshard(0)
        model(x.to(dtype or torch.float32)).float().square().mean().backward()
        sharded.reduce_grads(0)
        sharded.reshard(0)
        sharded.finish_grads()
        opt.step()
        opt.zero_grad()
    precision = "bf16" if dtype is not None else "fp32"
    kw = {k: True for k in offload}
    layout = MemoryLayout(1, stage, precision, offload_optimizer="offload_optimizer" in kw,
                    offload_params="offload_params" in kw)  # fmt: skip
    predicted = sum(unit_host_bytes(u, layout) for u in profile.units)
    # the host gradient (fp32) stays between steps: it is part of the offloaded state
    assert all(b.grads.cpu_grad is not None for b in sharded.buckets)
    assert _host_tensors(sharded, opt) == predicted
    # on a CUDA device it is beside the device's memory; on a CPU device inside it
    cpu = MemoryLayout(1, stage, precision, offload_optimizer=layout.offload_optimizer,
                 offload_params=layout.offload_params, device="cpu")  # fmt: skip
    for u in profile.units:
        assert unit_state_bytes(u, cpu) == unit_state_bytes(u, layout) + unit_host_bytes(u, cpu)


def test_offload_on_a_cpu_device_costs_memory_and_auto_drops_it():
    from mpar.partition import SearchSpace, search

    x = torch.randn(8, 64)
    profile = profile_model(_model(), (x,), repeats=1, warmup=0)
    for device in ("cpu", "cuda"):
        plain = make_plan(profile, _run(world=2, device=device, zero={"stage": 2}))
        offloaded = make_plan(
            profile,
            _run(world=2, device=device, zero={"stage": 2, "offload_optimizer": "cpu"}),
        )
        assert offloaded.host_memory_bytes[0] > 0 == plain.host_memory_bytes[0]
        if device == "cpu":  # the host gradient comes on top of the same state
            assert offloaded.rank_memory_bytes[0] > plain.rank_memory_bytes[0]
        else:
            assert offloaded.rank_memory_bytes[0] < plain.rank_memory_bytes[0]
    space = SearchSpace(precisions=("fp32",), checkpointing=(False,))
    on_cpu = _run(world=2, device_memory="1GiB")
    cpu = search(profile, on_cpu, global_batch=8, space=space, profile_batch=8)
    assert not any(c.offload_optimizer or c.offload_params for c in cpu.ranked)
    assert cpu.rejected["offload on a CPU device (the host is the device: it saves nothing)"]
    assert cpu.best.inputs.device == cpu.device == "cpu"
    # on CUDA a host cap rejects what offloads more than it allows
    on_cuda = _run(world=2, device="cuda", device_memory="1GiB")
    cuda = dict(global_batch=8, space=space, profile_batch=8)
    roomy = search(profile, on_cuda, **cuda, top=100)
    assert any(c.offload_optimizer for c in roomy.ranked)
    capped = search(profile, on_cuda, **cuda, top=100, host_memory=1)
    assert capped.rejected["over host memory cap"] > 0
    assert not any(c.max_host_memory_bytes for c in capped.ranked)


FACTORY = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                        nn.Linear(256, 8))
    return net, torch.randn(4, 32)
"""


def test_plan_scales_the_microbatch_for_the_global_batch(tmp_path, monkeypatch, capsys):
    from mpar.cli import main

    (tmp_path / "truth_factory.py").write_text(FACTORY)
    (tmp_path / "cfg.json").write_text(json.dumps({"microbatches": 2}))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "truth_factory", raising=False)
    argv = ["plan", "--model", "truth_factory:build", "--config", str(tmp_path / "cfg.json"),
            "--world-size", "1", "--device", "cpu"]  # fmt: skip
    assert main([*argv, "--global-batch", "32", "--json"]) == 0
    scaled = json.loads(capsys.readouterr().out)
    assert scaled["microbatch_size"] == 16  # 32 samples / 1 replica / 2 microbatches
    # measured: the same model profiled at 16 samples
    import truth_factory

    net, _ = truth_factory.build()
    at16 = profile_model(net, (torch.randn(16, 32),), repeats=1, warmup=0)
    direct = make_plan(at16, _run(microbatches=2))
    assert scaled["stages"][0]["activation_bytes"] == direct.stages[0].activation_bytes
    assert scaled["rank_memory_bytes"] == direct.rank_memory_bytes
    assert main([*argv]) == 0
    text = capsys.readouterr().out
    assert "microbatch: 4 samples (profile x1)" in text  # the example's, said so
    assert main([*argv, "--global-batch", "7"]) == 2
    assert "--global-batch 7 does not split into 1 replica(s) x 2" in capsys.readouterr().err


@pytest.mark.parametrize(("stage", "dtype"), [(0, torch.bfloat16), (2, torch.bfloat16), (1, None)])
def test_optimizer_update_adds_what_the_plan_says(stage, dtype):
    from mpar.partition._memory_model import optimizer_step_bytes
    from tests.multiproc._tensor_peak import TensorPeak

    x = torch.randn(8, 64)
    profile = profile_model(_model(), (x,), repeats=1, warmup=0)
    model = _model()
    sharded = ShardedStages({0: model}, ZeroConfig(stage), group=None, group_ranks=[0],
                            rank_in_group=0, device="cpu", compute_dtype=dtype)  # fmt: skip
    opt = sharded.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    for i in range(2):
        sharded.unshard(0)
        model(x.to(dtype or torch.float32)).float().square().mean().backward()
        sharded.reduce_grads(0)
        sharded.reshard(0)
        sharded.finish_grads()
        if i:
            with TensorPeak() as peak:
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    layout = MemoryLayout(1, stage, "bf16" if dtype else "fp32", gather="chunk")
    copies, temporaries = optimizer_step_bytes(profile.units, layout)
    # mixed precision: an fp32 copy of the gradients, and Adam's sqrt and div of the
    # second moment on the one segment (the whole bucket: one optimizer group)
    assert peak.peak == copies + temporaries, peak.at_peak


def test_tensor_peak_counts_a_storage_that_takes_a_freed_ones_address():
    """A storage resized to 0 (ZeRO's freed buffers) gives its memory back while it lives;
    the next allocation often lands at the same address and must still be counted."""
    from tests.multiproc._tensor_peak import TensorPeak

    for _ in range(20):  # the allocator reuses the address most of the time, not always
        with TensorPeak() as peak:
            freed = torch.empty(32768)
            freed.untyped_storage().resize_(0)
            kept = torch.ones(32768)
            total = kept + 1
        assert peak.peak == 2 * 32768 * 4, peak.at_peak
        del freed, total


def test_zero_bubble_allowance_is_counted_on_every_rank():
    """active_microbatches above ZB-H1's 2 lets the measured placement hold 3 on any
    rank: the plan counts 3 microbatches of activations there; a cap or another
    schedule is unchanged."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # activations dominate
    profile = profile_model(net, (torch.randn(2048, 64),), repeats=1, warmup=0)
    options = dict(microbatches=4, pipeline="zero_bubble")
    base = make_plan(profile, _run(2, **options))
    allowed = make_plan(profile, _run(2, **options, active_microbatches=3))
    assert allowed.boundaries == base.boundaries
    for before, after in zip(base.stages, allowed.stages):  # 3 microbatches held, not 2
        assert 2 * after.activation_bytes == 3 * before.activation_bytes
    assert max(allowed.rank_memory_bytes) > max(base.rank_memory_bytes)
    same = make_plan(profile, _run(2, **options, active_microbatches=2))
    assert same.rank_memory_bytes == base.rank_memory_bytes
    options["pipeline"] = "interleaved"
    plain = make_plan(profile, _run(2, **options))
    assert make_plan(profile, _run(2, **options, active_microbatches=3)).rank_memory_bytes == (
        plain.rank_memory_bytes
    )


@pytest.mark.parametrize(("pipeline", "cap", "held"), [("simple", 2, 2), ("interleaved", 1, 1)])
def test_a_cap_on_microbatches_in_flight_is_counted(pipeline, cap, held):
    """``active_microbatches`` below the schedule's peak caps what the runtime holds and
    lengthens its step: the plan counts the capped schedule's microbatches in flight and
    simulates its step, as the runtime builds it."""
    from mpar.partition._prediction import phase_times
    from mpar.schedule import StageCosts, build_schedule, simulate

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    profile = profile_model(net, (torch.randn(2048, 64),), repeats=1, warmup=0)
    options = dict(microbatches=8, pipeline=pipeline)
    free = make_plan(profile, _run(2, **options))
    capped = make_plan(profile, _run(2, **options, active_microbatches=cap))
    assert capped.boundaries == free.boundaries
    assert [s.in_flight for s in capped.stages] == [held, held]
    assert max(s.in_flight for s in free.stages) > held
    for before, after in zip(free.stages, capped.stages):
        assert after.activation_bytes * before.in_flight == before.activation_bytes * held
    # every rank whose schedule held more than the cap holds less (which rank peaks
    # follows the measured split, so compare rank by rank)
    lowered = [
        after < before
        for before, after, stage in zip(
            free.rank_memory_bytes, capped.rank_memory_bytes, free.stages, strict=True
        )
        if stage.in_flight > held
    ]
    assert lowered and all(lowered)
    fwd, bwd = phase_times(capped.stages, False, CostModel())
    schedule = build_schedule(pipeline, 2, 8, active_microbatches=cap)
    expected = simulate(schedule, StageCosts(fwd, bwd)).makespan
    assert capped.step_time_s - capped.overhead_s == pytest.approx(expected)
    assert capped.step_time_s > free.step_time_s  # the cap costs time


def test_a_split_backward_counts_what_a_waiting_w_keeps():
    """Under zero_bubble a microbatch whose W waits holds its linear layers' inputs and
    output gradients; where that is more than the forward saved (a wide last layer,
    whose output gradient nothing saves), each microbatch in flight counts the larger.
    1F1B, and zero_bubble with ``split_backward: false``, count what the forward saved."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 1024))
    profile = profile_model(net, (torch.randn(256, 64),), repeats=1, warmup=0)
    head = profile.units[-1]
    assert head.weight_work_bytes == 4 * 256 * (64 + 1024) > head.activation_bytes
    split = make_plan(profile, _run(2, microbatches=4, pipeline="zero_bubble"), method="uniform")
    whole = make_plan(
        profile,
        _run(2, microbatches=4, pipeline="zero_bubble", split_backward=False),
        method="uniform",
    )
    plain = make_plan(profile, _run(2, microbatches=4), method="uniform")
    assert split.boundaries == whole.boundaries == plain.boundaries
    last = [p.stages[-1] for p in (split, whole, plain)]
    assert [s.in_flight for s in last] == [2, 2, 1]
    units = [u for u in profile.units if u.name in last[0].units]
    saved = sum(u.activation_bytes for u in units)
    larger = sum(max(u.activation_bytes, u.weight_work_bytes) for u in units)
    assert larger > saved
    assert last[0].activation_bytes == 2 * larger
    assert last[1].activation_bytes == 2 * saved
    assert last[2].activation_bytes == saved
    assert split.rank_memory_bytes[1] > whole.rank_memory_bytes[1]
    assert split.rank_memory_bytes[0] == whole.rank_memory_bytes[0]  # no wide layer there
