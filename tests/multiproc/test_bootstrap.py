"""mpar.init over N gloo ranks through the shared harness."""

from __future__ import annotations

import pytest

from mpar.testing import DistributedTestError, run_distributed


def _grid_and_all_reduce(config):
    import torch

    import mpar
    from mpar.comm._collectives import all_reduce_dp

    mpar.init(config)
    value = torch.tensor([float(mpar.rank())])
    st = mpar.comm.state()
    all_reduce_dp(value, st.grid)
    return {
        "rank": mpar.rank(),
        "size": mpar.size(),
        "pp": (mpar.pp_rank(), mpar.pp_size()),
        "dp": (mpar.dp_rank(), mpar.dp_size()),
        "tp": (mpar.tp_rank(), mpar.tp_size()),
        "pp_groups": st.grid.topology.pp_groups,
        "dp_sum": value.item(),
        "dp_ranks": st.grid.dp_ranks,
    }


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_pp2_dp2_grid_and_dp_all_reduce(placement):
    config = {"pipeline_parallel_degree": 2, "placement_strategy": placement}
    results = run_distributed(_grid_and_all_reduce, 4, args=(config,), timeout=90)
    assert len({str(r["pp_groups"]) for r in results}) == 1  # same grid everywhere
    for r in results:
        assert r["size"] == 4 and r["pp"][1] == 2 and r["dp"][1] == 2
        assert r["tp"] == (0, 1)  # no tensor parallelism configured: one rank per TP group
        assert r["dp_sum"] == float(sum(r["dp_ranks"]))
    assert sorted((r["pp"][0], r["dp"][0]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("world", [1, 3, 8])
def test_harness_scales_from_one_to_eight_ranks(world):
    results = run_distributed(_grid_and_all_reduce, world, args=({},), timeout=120)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["dp_sum"] == world * (world - 1) / 2 for r in results)


def _init_twice():
    import mpar

    mpar.init()
    try:
        mpar.init()
    except RuntimeError as exc:
        message = str(exc)
    mpar.shutdown()
    mpar.init()  # allowed again after shutdown
    return message


def test_second_init_is_a_clear_error():
    (message,) = run_distributed(_init_twice, 1, timeout=60)
    assert "already called" in message and "mpar.shutdown()" in message


def _init_again_and_again(rounds):
    import time

    import torch
    import torch.distributed as dist

    import mpar

    sums = []
    for i in range(rounds):
        mpar.init({"pipeline_parallel_degree": 2 if i % 2 else 1})
        if mpar.rank() == 0:
            time.sleep(0.3)  # the others reach their next init while rank 0 is still here
        value = torch.ones(1) * (i + 1)
        dist.all_reduce(value)
        sums.append(float(value))
        mpar.shutdown()
    return sums


def test_init_after_shutdown_in_the_same_processes_rendezvouses_afresh():
    # A new store per init raced: early ranks reached the old one or its stale addresses.
    results = run_distributed(_init_again_and_again, 4, args=(4,), timeout=120)
    assert results == [[4.0, 8.0, 12.0, 16.0]] * 4


def _fail_on_rank_one():
    import mpar

    mpar.init({"timeout_s": 60})
    if mpar.rank() == 1:
        raise ValueError("deliberate failure on rank one")
    mpar.barrier()


def test_failing_rank_traceback_is_shown_and_nothing_hangs():
    with pytest.raises(DistributedTestError, match="rank 1 of 3 failed") as info:
        run_distributed(_fail_on_rank_one, 3, timeout=60)
    assert "deliberate failure on rank one" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)  # the traceback, not just the message


def _hang_on_rank_zero():
    import time

    import mpar

    mpar.init({"timeout_s": 60})
    if mpar.rank() == 0:
        time.sleep(60)
    mpar.barrier()


def test_timeout_reports_stacks_of_hung_ranks():
    with pytest.raises(DistributedTestError, match="did not finish within 5 s") as info:
        run_distributed(_hang_on_rank_zero, 2, timeout=5)
    assert "_hang_on_rank_zero" in str(info.value)


def _bad_world_for_config():
    import mpar

    mpar.init({"pipeline_parallel_degree": 3})


def test_pipeline_degree_must_divide_world_size():
    with pytest.raises(DistributedTestError, match="must divide the world size"):
        run_distributed(_bad_world_for_config, 2, timeout=60)


def _init_with_world_size(odd_rank, world):
    import os

    import mpar

    if os.environ["RANK"] == str(odd_rank):  # as if set by hand, differently from the other's
        os.environ["WORLD_SIZE"] = str(world)
    try:
        mpar.init({"timeout_s": 60})
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("odd_rank", [0, 1])
def test_ranks_given_different_world_sizes_fail_at_once(odd_rank):
    """Two processes, one of them told the job has three: both say so within seconds,
    where they waited until the timeout (rank 0, in its store, for a third process that
    never came; rank 1, in gloo, for a peer rank 0 did not know of) and failed in gloo."""
    got = run_distributed(_init_with_world_size, 2, args=(odd_rank, 3), timeout=30)
    world = [3 if rank == odd_rank else 2 for rank in range(2)]
    for rank, peer in ((0, 1), (1, 0)):
        assert (
            f"rank {rank} was started with WORLD_SIZE={world[rank]} but rank {peer} with "
            f"WORLD_SIZE={world[peer]}: every process of a job must be given the same world size"
        ) in got[rank]


def _mesh_and_fallback_groups(config):
    import torch.distributed as dist

    import mpar
    from mpar.comm import _grid

    mpar.init(config)
    grid = mpar.comm.state().grid
    # The path for backends a DeviceMesh cannot carry (MPI, XLA), built here over gloo.
    fallback = _grid._with_new_groups(grid.topology, grid.rank, ("gloo", "gloo"), grid.timeout)

    def ranks(g):
        return [
            sorted(dist.get_process_group_ranks(getattr(g, f"{a}_group")))
            for a in ("pp", "dp", "cp", "tp", "dp_cp")
        ]

    out = {
        "mesh": (grid.mesh.mesh_dim_names, tuple(grid.mesh.shape), grid.mesh.get_coordinate()),
        "coords": (grid.pp_rank, grid.dp_rank, grid.cp_rank, grid.tp_rank),
        "mesh_groups": ranks(grid),
        "fallback_groups": ranks(fallback),
        "expected": [
            sorted(ranks)
            for ranks in (
                grid.pp_ranks,
                grid.dp_ranks,
                grid.cp_ranks,
                grid.tp_ranks,
                grid.dp_cp_ranks,
            )
        ],
    }
    mpar.shutdown()
    return out


@pytest.mark.parametrize(
    ("placement", "cp", "shape"),
    [("cluster", 1, (2, 2, 1, 1)), ("spread", 1, (2, 2, 1, 1)), ("cluster", 2, (2, 1, 2, 1))],
)
def test_the_device_mesh_holds_the_grid_groups_as_new_group_would(placement, cp, shape):
    """The DeviceMesh over (pp, dp, cp, tp) gives each rank the groups of the pure grid,
    the same as the ``new_group`` path that MPI and XLA backends take (and the dp x cp
    group, made with ``new_group`` on both paths)."""
    config = {"pipeline_parallel_degree": 2, "placement_strategy": placement, "cp": cp}
    for r in run_distributed(_mesh_and_fallback_groups, 4, args=(config,), timeout=90):
        assert r["mesh"][:2] == (("pp", "dp", "cp", "tp"), shape)
        assert tuple(r["mesh"][2]) == r["coords"]
        assert r["mesh_groups"] == r["fallback_groups"] == r["expected"]
