"""The shared-memory rings' files never outlive their job, and a full ``/dev/shm`` is
never a SIGBUS.

Each job here keeps its rings in a private folder (``_shared.ROOT``), so that other
jobs on the host neither disturb the counts nor are disturbed. A job ends by an
exception in step 0 (before a rank's first receive, after its peer made the ring),
by the watchdog, or by SIGKILL of every rank; once the next job on the host has
started, the folder holds no file of it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpar.testing import DistributedTestError, run_distributed

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 30}


def _files(root: str) -> list[str]:
    """The rings' files in ``root`` (of this mpar, or of an earlier one: ``mpar-…``)."""
    return sorted(n for n in os.listdir(root) if n.startswith("mpar-"))


def _wait_for_ring(root: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not [n for n in _files(root) if "-ring-" in n]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no ring appeared in {root}")
        time.sleep(0.005)


def _send_and_fail(root: str, how: str) -> None:
    """Two pipeline ranks; rank 0 sends the first activation of step 0 (its ring is
    made), and rank 1 fails before its first receive: ``raise`` (an exception), ``hang``
    (the watchdog ends the job), ``kill`` (every rank SIGKILLed the moment the ring
    appears)."""
    import threading

    import torch

    import mpar
    from mpar.comm import _shared, state
    from mpar.comm._p2p import PendingSends, send_payload
    from mpar.comm._types import Transfer, TransferLabel

    _shared.ROOT = root
    mpar.init({**PP2, "timeout_s": 3} if how == "hang" else PP2)
    if how == "kill":
        die = lambda: (_wait_for_ring(root), os.kill(os.getpid(), signal.SIGKILL))  # noqa: E731
        threading.Thread(target=die, daemon=True).start()
    if mpar.rank() == 0:
        pending = PendingSends()
        label = TransferLabel(Transfer.ACTIVATIONS, 1, 0)
        send_payload((torch.ones(4, 8),), 1, label, pending, state().p2p_links)
        mpar.barrier()  # waits for rank 1, which never comes
    _wait_for_ring(root)
    if how == "raise":
        raise ValueError("a bug in the user's step 0")
    time.sleep(60)  # the watchdog, or the SIGKILL, ends the job first


def _next_job(root: str) -> list[str]:
    """The next job on the host: ``mpar.init`` (no rings of its own: one process)."""
    import mpar
    from mpar.comm import _shared

    _shared.ROOT = root
    mpar.init()
    return _files(root)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "hang", "kill"])
def test_no_ring_file_outlives_its_job(tmp_path, how):
    # Before: an exception in step 0 and a watchdog ending left the 4 MiB ring (3 of 3
    # runs), a SIGKILLed job left one in 1 of 2, and no later job removed them.
    root = str(tmp_path)
    match = {"raise": "a bug in the user's step 0", "hang": "hang", "kill": "exit code -9"}[how]
    with pytest.raises(DistributedTestError, match=match):
        run_distributed(_send_and_fail, 2, args=(root, how), timeout=90)
    if how == "kill":
        assert _files(root), "the killed job left nothing: the test tests nothing"
    (left,) = run_distributed(_next_job, 1, args=(root,), timeout=60)
    assert left == [] and _files(root) == []


def test_a_sweep_removes_only_the_files_no_live_process_holds(tmp_path, monkeypatch):
    from mpar.comm import _shared

    monkeypatch.setattr(_shared, "ROOT", str(tmp_path))
    live = [_shared._create(f"{tmp_path}/{_shared.PREFIX}a-0-flag", 64)]
    live.append(_shared._create(f"{tmp_path}/{_shared.PREFIX}a-0-bell", fifo=True))
    dead = _shared._create(f"{tmp_path}/{_shared.PREFIX}b-0-ring-7", 4096)
    os.close(dead)  # its maker is gone: nothing holds its lock
    (tmp_path / "mpar-0123-0-ring-1").write_bytes(b"")  # not ours (an older mpar's)
    assert _shared.sweep() == [f"{_shared.PREFIX}b-0-ring-7"]
    left = sorted(os.listdir(tmp_path))
    assert left == ["mpar-0123-0-ring-1", f"{_shared.PREFIX}a-0-bell", f"{_shared.PREFIX}a-0-flag"]
    for fd in live:
        os.close(fd)
    assert len(_shared.sweep()) == 2 and os.listdir(tmp_path) == ["mpar-0123-0-ring-1"]
    fd = os.open(tmp_path / "mpar-0123-0-ring-1", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (never locked by the sweep either)
    os.close(fd)


# ---------------------------------------------------------------- a full /dev/shm

_FULL_SCRIPT = """
import json, sys
from mpar.testing import run_distributed
from tests.multiproc.test_shared_memory_files import _train_in
print("RESULT " + json.dumps(run_distributed(_train_in, 2, args=(sys.argv[1],), timeout=120)))
"""


def _train_in(root: str) -> dict[str, object]:
    """Train the pipeline MLP two steps with its rings in ``root``; the losses."""
    import mpar
    from mpar.comm import _shared, state
    from tests.multiproc._pipeline_cases import batch, make_optimizer, start_training

    _shared.ROOT = root
    model, opt, train = start_training(PP2, lambda p: make_optimizer("sgd", p))
    shared = state().p2p_links.shared
    losses = []
    for s in range(2):
        losses.append(float(train(model, *batch("mlp", s)).reduce_mean()))
        opt.step()
        opt.zero_grad()
    rings = None if shared is None else sum(r is not None for r in shared._rings_out.values())
    mpar.shutdown()
    return {"losses": losses, "rings": rings, "left": _files(root)}


def _in_small_tmpfs(tmp_path: Path, size: str) -> list[dict[str, object]]:
    """``_train_in`` with the rings' folder a tmpfs of ``size`` (a private mount)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs")
    mount = tmp_path / "shm"
    mount.mkdir()
    shell = 'mount -t tmpfs -o size="$1" tmpfs "$0" && exec "$2" -c "$3" "$0"'
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = ["unshare", "-rm", "sh", "-c", shell, str(mount), size, sys.executable, _FULL_SCRIPT]
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=root, env=env)
    refused = "Operation not permitted" in done.stderr or "unshare failed" in done.stderr
    if refused and "RESULT" not in done.stdout:
        pytest.skip(f"no private mount here: {done.stderr.strip()[:200]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the job failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    import json

    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("size", "rings"), [("68k", 0), ("4k", None)], ids=["room-for-flags-not-rings", "one-flag"]
)
def test_a_full_dev_shm_falls_back_to_the_backend_never_sigbus(tmp_path, size, rings):
    # Before: with room for one small ring and not the flags' pages, a rank died of
    # SIGBUS reading its peer's flag file, and the launcher only said "killed by SIGBUS".
    # (A real tmpfs in a private mount; in the default suite: the test below.)
    from tests.multiproc._pipeline_cases import reference

    results = _in_small_tmpfs(tmp_path, size)
    want = reference("mlp", "sgd", 2)["losses"]
    for r in results:
        assert r["rings"] == rings  # 68k: the flags fit, no ring does; 4k: no rings at all
        assert r["left"] == []
        for got, expected in zip(r["losses"], want):
            assert abs(got - expected) < 1e-5


def test_files_are_reserved_before_they_are_mapped_else_the_backend_carries(tmp_path, monkeypatch):
    """No room to reserve (ENOSPC from posix_fallocate, as on a full tmpfs): a rank makes
    no flag it could not touch (no rings, a warning), and a stream no ring (an empty
    file: its receiver sends it through the backend). Before: the flag was never
    reserved, and its first touched page could be a SIGBUS."""
    import errno
    import warnings

    from mpar.comm import _shared

    monkeypatch.setattr(_shared, "ROOT", str(tmp_path))

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _shared._own_files("t", 0, 0.0) is None
    assert "no room in" in str(caught[0].message) and "go through the backend" in str(
        caught[0].message
    )
    assert _files(str(tmp_path)) == []  # nothing half made is left
    fd, memory = _shared._make_ring(f"{tmp_path}/{_shared.PREFIX}t-1-ring-2")
    assert memory is None and os.path.getsize(f"{tmp_path}/{_shared.PREFIX}t-1-ring-2") == 0
    os.close(fd)
