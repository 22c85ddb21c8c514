"""The planner's ZeRO 2/3 working set by gather granularity (``MemoryLayout.gather``)."""

from __future__ import annotations

import pytest

from mpar.config import config_from_dict, load_config
from mpar.errors import PartitionError
from mpar.partition import (
    MemoryLayout,
    PlanInputs,
    SearchSpace,
    ZeroSetup,
    make_plan,
    plan_inputs,
    search,
)
from mpar.partition._cost import zero3_gathers_per_step
from mpar.partition._memory_model import (
    effective_gather,
    may_split_backward,
    working_set_for_solver,
    zero_working_set_bytes,
)
from mpar.profile import ModelProfile, UnitProfile

MiB = 2**20


def _run(pp: int = 1, *, world: int | None = None, **config: object) -> PlanInputs:
    """The planner's inputs for these config keys on ``world`` ranks (default ``pp``)."""
    cfg = config_from_dict({"pipeline_parallel_degree": pp, **config})
    return plan_inputs(cfg, world or pp, device="cuda")


def _unit(i, params):
    return UnitProfile(
        name=f"u{i}",
        param_count=params // 4,
        param_bytes=params,
        grad_bytes=params,
        optimizer_bytes=2 * params,
        flops=0,
        time_s=1e-3,
        activation_bytes=8 * MiB,
        output_bytes=MiB,
    )


def _profile(sizes):
    units = [_unit(i, s) for i, s in enumerate(sizes)]
    return ModelProfile(units, "measure", "adam", sum(u.param_count for u in units))


def test_working_set_grows_from_unit_to_groups_to_chunk():
    units = [_unit(i, p) for i, p in enumerate((100, 400, 300, 200))]

    def ws(zero, gather, **kw):
        return zero_working_set_bytes(units, MemoryLayout(4, zero, gather=gather, **kw))

    # ZeRO-3 by unit or group: after a group's backward its gradients twice (autograd's
    # and the flat reduction buffer), with its parameters and its larger neighbour's
    assert ws(3, "unit") == 2 * 400 + (400 + 300)
    assert ws(3, 1) == ws(3, "unit")
    assert ws(3, 2) == 2 * 500 + (500 + 500)  # groups (100, 400), (300, 200)
    assert ws(3, 3) == 2 * 800 + (800 + 200)  # groups (100, 400, 300), (200)
    # by chunk the .grad are views of the one flat buffer: gradients once; a group of the
    # whole stage still reduces autograd's gradients through a copy
    assert ws(3, "chunk") == 1000 + 1000  # the whole stage, gathered and reduced
    assert ws(3, 4) == 2 * 1000 + 1000
    assert ws(3, "unit") < ws(3, 2) < ws(3, 3)
    # ZeRO-2: gradients only; a full-size buffer for the stage by chunk
    assert ws(2, "unit") == 2 * 400
    assert ws(2, "chunk") == 1000
    assert ws(1, "chunk") == 0  # ZeRO-0/1 count the full buffer in the state already
    assert ws(3, "chunk", precision="bf16") == 1000
    # one rank: nothing gathered or reduce-scattered, unless parameters live on the host
    assert zero_working_set_bytes(units, MemoryLayout(1, 3, gather="chunk")) == 0
    offloaded = MemoryLayout(1, 3, offload_params=True, gather="chunk")
    assert zero_working_set_bytes(units, offloaded) == 1000


def test_solver_gets_chunk_additively_and_a_reserve_that_bounds_every_stage():
    units = [_unit(i, p) for i, p in enumerate((100, 400, 300, 200, 500, 50, 250))]
    chunk = MemoryLayout(4, 3, gather="chunk")
    per_unit, reserve = working_set_for_solver(units, chunk)
    assert reserve == 0
    for a in range(len(units)):
        for b in range(a + 1, len(units) + 1):
            assert sum(per_unit[a:b]) == zero_working_set_bytes(units[a:b], chunk)
    for gather in ("unit", 2, 3):
        layout = MemoryLayout(4, 3, gather=gather)
        per_unit, reserve = working_set_for_solver(units, layout)
        assert per_unit == [0.0] * len(units)
        stages = [
            zero_working_set_bytes(units[a:b], layout)
            for a in range(len(units))
            for b in range(a + 1, len(units) + 1)
        ]
        assert max(stages) == reserve  # a bound every stage respects, and reached


def test_split_backward_pipelines_gather_by_chunk():
    for pipeline in ("zero_bubble", "zbv", "my/schedule.csv", "MY.CSV"):
        assert may_split_backward(pipeline)
        assert effective_gather(pipeline, "unit") == "chunk"
        assert effective_gather(pipeline, 2) == "chunk"
    for pipeline in ("interleaved", "simple"):
        assert not may_split_backward(pipeline)
        assert effective_gather(pipeline, "unit") == "unit"
        assert effective_gather(pipeline, 3) == 3
        assert effective_gather(pipeline, "chunk") == "chunk"
    # the runtime asks the same function (mpar.runtime._sharding)
    from mpar.runtime import _sharding

    assert _sharding.effective_gather is effective_gather


@pytest.mark.parametrize("bad", ["layer", "", 0, -2, True, 1.5, None])
def test_bad_gather_values_raise(bad):
    with pytest.raises(PartitionError, match="gather must be"):
        MemoryLayout(2, 3, gather=bad)
    with pytest.raises(PartitionError, match="gather must be"):
        ZeroSetup(3, gather=bad)


def test_zero_bubble_plan_predicts_the_chunk_it_gathers():
    prof = _profile([4 * MiB, 8 * MiB] * 4)
    kw = dict(world=4, microbatches=4)
    unit = make_plan(prof, _run(2, zero={"stage": 3}, **kw), method="uniform")
    zb = make_plan(prof, _run(2, pipeline="zero_bubble", zero={"stage": 3}, **kw), method="uniform")
    chunk = make_plan(prof, _run(2, zero={"stage": 3, "gather": "chunk"}, **kw), method="uniform")
    assert (unit.layout.gather, zb.layout.gather, chunk.layout.gather) == (
        "unit",
        "chunk",
        "chunk",
    )
    assert max(zb.rank_memory_bytes) > max(unit.rank_memory_bytes)
    # 4 units of 4 + 8 + 4 + 8 MiB a stage: chunk 24 + 24 MiB against unit 2 x 8 + (8 + 4)
    for z, u in zip(zb.stages, unit.stages):
        assert z.extra_bytes - u.extra_bytes >= 20 * MiB
    for c, u in zip(chunk.stages, unit.stages):
        assert c.extra_bytes - u.extra_bytes == 20 * MiB
    assert "gathers and reduces by the whole stage (the schedule splits" in str(zb)
    # by chunk a stage is gathered once a step (twice with reshard_after_forward), not per action
    assert zero3_gathers_per_step(4, "chunk") == 2 < zero3_gathers_per_step(4, "unit") == 8
    assert zb.overhead_s < unit.overhead_s


def test_search_evaluates_split_backward_schedules_by_chunk():
    prof = _profile([4 * MiB, 8 * MiB] * 4)
    kw = dict(global_batch=8, top=100)
    base = _run(world=4, device_memory="4GiB")
    space = dict(zero_stages=(3,), offload=False, checkpointing=(False,), precisions=("fp32",))
    zb = search(prof, base, space=SearchSpace(pipelines=("zero_bubble", "zbv"), **space), **kw)
    assert zb.ranked
    assert {c.pipeline for c in zb.ranked} == {"zero_bubble", "zbv"}
    assert all(c.virtual_stages == 2 for c in zb.ranked if c.pipeline == "zbv")
    for c in zb.ranked:
        assert c.inputs.memory_layout().gather == "chunk"
        assert "gather" not in c.config()["zero"]  # the runtime decides it from the schedule
        plan = make_plan(prof, c.inputs, microbatch_scale=c.microbatch_size)
        assert plan.rank_memory_bytes == c.rank_memory_bytes
    # the same shapes under 1F1B gather by unit and predict less (with 4 units a stage;
    # with 2, a unit's gradients twice outweigh the chunk's flat buffer)
    il = search(prof, base, space=SearchSpace(pipelines=("interleaved",), **space), **kw)
    peaks = {
        (c.pipeline_parallel_degree, c.microbatches, c.virtual_stages): c.max_rank_memory_bytes
        for c in il.ranked
    }
    compared = 0
    for c in zb.ranked:
        key = (c.pipeline_parallel_degree, c.microbatches, c.virtual_stages)
        wide = c.pipeline_parallel_degree == 2 and c.virtual_stages == 1
        if c.pipeline == "zero_bubble" and wide and key in peaks:
            assert c.max_rank_memory_bytes > peaks[key]
            compared += 1
    assert compared
    # a configured group size travels into the candidate's config
    grouped_base = _run(world=4, device_memory="4GiB", zero={"gather": 2})
    grouped = search(prof, grouped_base, space=SearchSpace(**space), **kw)
    assert grouped.best.config()["zero"]["gather"] == 2
    assert grouped.best.inputs.memory_layout().gather == 2


def test_cli_plan_reads_zero_gather():
    from argparse import Namespace

    from mpar.cli._plan import plan_inputs_of

    config = load_config(
        {"pipeline_parallel_degree": 2, "zero": {"stage": 3, "gather": 2}, "microbatches": 2}
    )
    args = Namespace(world_size=4, device="cuda", device_memory=None)
    inputs = plan_inputs_of(args, config)
    assert inputs.zero.gather == 2
    plan = make_plan(_profile([MiB] * 4), inputs)
    assert plan.layout.gather == 2


def test_runtime_auto_searches_the_configured_split_backward_schedule():
    from mpar.partition import space_around

    config = load_config(
        {
            "pipeline_parallel_degree": 2,
            "pipeline": "zero_bubble",
            "microbatches": "auto",
            "zero": {"stage": 3, "gather": 2},
            "device_memory": "1GiB",
        }
    )
    inputs = plan_inputs(config, 4, device="cuda")
    space = space_around(inputs, config.auto_keys)
    assert space.pipelines == ("zero_bubble",) and space.pipeline_degrees == (2,)
    result = search(_profile([4 * MiB, 8 * MiB] * 4), inputs, global_batch=8, space=space, top=3)
    assert result.best.pipeline == "zero_bubble" and result.best.pipeline_parallel_degree == 2
    assert result.best.inputs.zero.gather == 2  # the configured value, in its config too
    assert result.best.inputs.memory_layout().gather == "chunk"  # zero_bubble: by chunk
