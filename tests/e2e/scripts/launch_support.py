"""Support for tests/e2e/test_launch*.py: run ``python -m mpar.launch`` (or a recipe)
as a user would, and check that no process is left behind.

Every process a test starts carries a unique ``MPAR_TEST_TOKEN`` in its
environment, inherited by everything it starts in turn (torch's workers,
mpiexec's ranks); after the job, no live process may still carry it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    token: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def summary(self) -> list[str]:
        """The launcher's own report lines."""
        return [line for line in self.stderr.splitlines() if line.startswith("mpar launch")]


def child_env(token: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MPAR_TEST_TOKEN"] = token
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MPAR_CONFIG"):
        env.pop(name, None)
    env.update(extra or {})
    return env


def start(cmd: list[str], env: dict[str, str], files: tuple[Path, Path]) -> subprocess.Popen[bytes]:
    out, err = (open(path, "wb") for path in files)  # noqa: SIM115 - closed by the caller
    with out, err:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True
        )


def run(cmd: list[str], *, timeout: float, env_extra: dict[str, str] | None = None) -> Result:
    """Run ``cmd`` to completion (killing its session on timeout), then check for orphans."""
    token = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as tmp:
        files = (Path(tmp) / "out", Path(tmp) / "err")
        began = time.monotonic()
        proc = start(cmd, child_env(token, env_extra), files)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kill_marked(token)
            raise AssertionError(f"{cmd} did not finish in {timeout} s:\n{read(files)}") from None
        result = Result(code, *read_pair(files), time.monotonic() - began, token)
    assert_no_orphans(token, result)
    return result


def launch(*args: str, timeout: float = 60, env_extra: dict[str, str] | None = None) -> Result:
    return run([sys.executable, "-m", "mpar.launch", *args], timeout=timeout, env_extra=env_extra)


def read_pair(files: tuple[Path, Path]) -> tuple[str, str]:
    return tuple(path.read_text(errors="replace") for path in files)  # type: ignore[return-value]


def read(files: tuple[Path, Path]) -> str:
    return "\n".join(read_pair(files))


def marked_pids(token: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``MPAR_TEST_TOKEN=token``."""
    needle = f"MPAR_TEST_TOKEN={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_marked(token: str) -> None:
    for pid in marked_pids(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def assert_no_orphans(token: str, result: Result, grace: float = 3.0) -> None:
    deadline = time.monotonic() + grace
    while (left := marked_pids(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        kill_marked(token)
        raise AssertionError(f"processes left behind: {left}\n{result.output}")


def rank_lines(text: str) -> dict[int, dict[str, str]]:
    """``rank=R key=value ...`` lines printed by the test scripts, by rank.

    Ranks share the launcher's stdout, so two ranks' lines may be glued together
    (``...dp_size=2rank=2 ...``): chunks start at every ``rank=`` that is not the
    tail of a longer key such as ``pp_rank=``.
    """
    ranks = {}
    for chunk in re.split(r"(?<![A-Za-z_])(?=rank=\d+ )", text):
        if chunk.startswith("rank="):
            fields = dict(re.findall(r"(\w+)=(\S+)", chunk.split("\n")[0]))
            ranks[int(fields["rank"])] = fields
    return ranks
