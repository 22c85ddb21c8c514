"""Small faults found by trying mpar as a new user (issue 28): each is refused
early with a message that says what to do."""

from __future__ import annotations

import pytest

from mpar.config import load_config
from mpar.errors import ConfigError


def test_a_schedule_csv_whose_receives_come_out_of_send_order_is_refused_at_init(tmp_path):
    # compute-only: rank 1 runs microbatch 1 first, but stage 0 sends microbatch 0 first
    path = tmp_path / "swapped.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F1,1B1,1F0,1B0\n")
    config = {"pipeline": str(path), "pipeline_parallel_degree": 2, "microbatches": 2}
    with pytest.raises(ConfigError, match="1RECV_F1 comes before 1RECV_F0, but stage 0 sends"):
        load_config(config)  # as `mpar schedule` says, before any process group
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert load_config(config).pipeline == str(path)


def test_a_schedule_csv_holding_more_than_active_microbatches_is_refused(tmp_path):
    # before: accepted, and the file ran as written past the cap (2 in flight on rank 0)
    path = tmp_path / "gpipe.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n")
    config = {"pipeline": str(path), "pipeline_parallel_degree": 2, "microbatches": 2}
    with pytest.raises(ConfigError, match="holds 2 .* in flight on rank 0.* to 2 or more"):
        load_config({**config, "active_microbatches": 1})
    assert load_config({**config, "active_microbatches": 2}).active_microbatches == 2


def test_fp16_warns_when_it_keeps_skipping_steps():
    import warnings

    from mpar.shard._scaler import WARN_AFTER, LossScaler

    scaler = LossScaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(WARN_AFTER - 1):
            scaler.update(found_inf=True)
        scaler.update(found_inf=False)  # one good step resets the run
        for _ in range(WARN_AFTER - 1):
            scaler.update(found_inf=True)
        assert caught == []
        scaler.update(found_inf=True)
        assert len(caught) == 1
        assert f"the last {WARN_AFTER} optimizer steps were all skipped" in str(caught[0].message)
        for _ in range(4 * WARN_AFTER):
            scaler.update(found_inf=True)
    # 50 skipped in a row: warned at 10, 16 and 32, not at every step
    assert [str(w.message).split(" optimizer")[0] for w in caught] == [
        "fp16: the last 10",
        "fp16: the last 16",
        "fp16: the last 32",
    ]
