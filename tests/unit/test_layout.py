"""Process layout from torchrun, SLURM, or nothing (MPI is an e2e test)."""

from __future__ import annotations

import sys

import pytest

from mpar.comm import detect_layout, expand_slurm_nodelist
from mpar.errors import CommError


def test_single_process():
    layout = detect_layout({})
    assert (layout.rank, layout.world_size, layout.source) == (0, 1, "single")


def test_torchrun_variables():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "1234",
    }
    layout = detect_layout(env)
    assert (layout.rank, layout.world_size, layout.local_rank, layout.local_size) == (3, 4, 1, 2)
    assert (layout.master_addr, layout.master_port, layout.source) == ("10.1.2.3", 1234, "torchrun")
    with pytest.raises(CommError, match="RANK='x' is not an integer"):
        detect_layout({**env, "RANK": "x"})


def test_slurm_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "991",
    }
    layout = detect_layout(env)
    assert (layout.rank, layout.world_size, layout.local_rank, layout.local_size) == (5, 8, 1, 4)
    assert layout.master_addr == "gpu07" and layout.source == "slurm"
    assert detect_layout(dict(env)).master_port == layout.master_port  # same on every task
    # the batch script itself (no srun step) is not a rank of the job
    no_step = {k: v for k, v in env.items() if k != "SLURM_STEP_ID"}
    assert detect_layout(no_step).source == "single"


def test_expand_slurm_nodelist():
    assert expand_slurm_nodelist("a[01-03,07],b1") == ["a01", "a02", "a03", "a07", "b1"]
    assert expand_slurm_nodelist("node5") == ["node5"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": "4"}, "RANK=4 with WORLD_SIZE=4: ranks run from 0 to 3"),
        ({"RANK": "-1"}, "RANK=-1 with WORLD_SIZE=4"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0: a job has at least one process"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2: local ranks run from 0"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 with WORLD_SIZE=4"),
    ],
)
def test_an_impossible_torchrun_layout_is_named(change, message):
    """Variables set by hand that cannot describe a process of the job fail in
    ``mpar.init`` (RANK=4 of 4 crashed in gloo with a C++ stack)."""
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234", **change}  # fmt: skip
    with pytest.raises(CommError, match=f"impossible: {message}"):
        detect_layout(env)


def test_a_torchrun_layout_needs_the_rendezvous_address():
    with pytest.raises(CommError, match="MASTER_ADDR is not: every rank needs rank 0's"):
        detect_layout({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    with pytest.raises(CommError, match="MASTER_ADDR and MASTER_PORT are not"):
        detect_layout({"RANK": "1", "WORLD_SIZE": "2"})
    assert detect_layout({"RANK": "0", "WORLD_SIZE": "1"}).world_size == 1  # alone: no peer


def test_slurm_tasks_per_node_counts_this_node():
    """``srun -n 5`` over two nodes runs 3 + 2 tasks: the second node's tasks are 2 on
    their host (the first count was taken for every node: 3, and local rank 2 of them)."""
    env = {"SLURM_NTASKS": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_JOB_ID": "7"}  # fmt: skip
    second = {**env, "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "n2"}
    assert detect_layout(second).local_size == 2
    assert detect_layout({**second, "SLURMD_NODENAME": "x", "SLURM_NODEID": "1"}).local_size == 2
    first = {**env, "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURMD_NODENAME": "n1"}
    assert detect_layout(first).local_size == 3
    wide = {**env, "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NTASKS": "5"}
    assert detect_layout({**wide, "SLURM_PROCID": "4", "SLURM_NODEID": "2"}).local_size == 1
    with pytest.raises(CommError, match="impossible: SLURM_LOCALID=3 with"):
        detect_layout({**second, "SLURM_LOCALID": "3"})


def test_srun_with_pmix_reads_slurm_without_mpi4py(monkeypatch):
    """``srun --mpi=pmix`` sets PMIX_RANK for every task, MPI program or not: without
    mpi4py the SLURM variables give the layout (it was an error asking for mpi4py)."""
    from mpar.comm import _process_layout

    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2", "PMIX_RANK": "1"}  # fmt: skip
    monkeypatch.setattr(_process_layout, "_has_mpi4py", lambda: False, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` fails
    layout = detect_layout(env)
    assert (layout.source, layout.rank, layout.world_size, layout.local_size) == ("slurm", 1, 2, 2)
    without_slurm = {k: v for k, v in env.items() if not k.startswith("SLURM")}
    with pytest.raises(CommError, match="mpi4py is not installed"):
        detect_layout(without_slurm)


def test_a_torchrun_layout_of_one_process_needs_no_rendezvous_address(monkeypatch):
    """RANK=0 WORLD_SIZE=1 (as some notebooks and schedulers set them) starts alone:
    torch's env:// rendezvous asked for MASTER_ADDR, for nobody to meet."""
    import mpar

    for name in ("MASTER_ADDR", "MASTER_PORT", "MPAR_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        mpar.init()
        assert (mpar.rank(), mpar.size(), mpar.comm.state().layout.source) == (0, 1, "torchrun")
    finally:
        mpar.shutdown()
