"""Process layout from torchrun, SLURM, or nothing (MPI is an e2e test)."""

from __future__ import annotations

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
