"""Who owns a save: the root's lock refuses a second live writer; stale cleanup
removes only directories whose owner is gone (no processes of mpar's own)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpar.checkpoint import _dirs
from mpar.checkpoint._owner import (
    OWNER,
    STALE_AFTER_S,
    Owner,
    RootLock,
    SaveInProgressError,
    is_stale,
    write_owner,
)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _tmp_dir(root, owner):
    directory, _ = _dirs.new_tmp_dir(root, owner)
    return directory


def test_only_saves_whose_owner_is_gone_are_removed(tmp_path):
    live = _tmp_dir(tmp_path, Owner.here())
    dead = _tmp_dir(tmp_path, Owner("x", _dead_pid(), None, time.time()))
    write_owner(dead, Owner(Owner.here().host, _dead_pid(), None, time.time()))
    reused = _tmp_dir(tmp_path, Owner(Owner.here().host, os.getpid(), -1, time.time()))
    old_format = tmp_path / ".tmp-ckpt-000009-0123"
    old_format.mkdir()
    elsewhere = _tmp_dir(tmp_path, Owner("another-node", 1, None, time.time()))
    removed = _dirs.remove_stale(tmp_path)
    # a pid that died, a pid reused by another process (other start time), no owner file
    assert sorted(removed) == sorted([dead.name, reused.name, old_format.name])
    assert live.is_dir() and elsewhere.is_dir()
    assert not is_stale(elsewhere)
    aged = time.time() - STALE_AFTER_S - 60
    for path in [elsewhere, elsewhere / OWNER]:
        os.utime(path, (aged, aged))
    assert is_stale(elsewhere)  # another node's save with nothing written for an hour


_HOLD = """
import sys, time
from pathlib import Path
from mpar.checkpoint._owner import Owner, RootLock
lock = RootLock(Path(sys.argv[1]), Owner.here())
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_live_writer_is_refused_naming_the_first(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(SaveInProgressError, match=rf"pid {holder.pid} on host"):
            RootLock(tmp_path, Owner.here())
    finally:
        holder.kill()
        holder.wait()
    RootLock(tmp_path, Owner.here()).release()  # the lock dies with its holder
