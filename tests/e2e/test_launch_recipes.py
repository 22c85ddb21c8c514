"""The cluster recipes in launch/: what they expand to, and real runs where the engine exists."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

_SUPPORT = Path(__file__).with_name("scripts") / "launch_support.py"
_spec = importlib.util.spec_from_file_location("mpar_launch_support", _SUPPORT)
assert _spec is not None and _spec.loader is not None
support = sys.modules.get(_spec.name) or importlib.util.module_from_spec(_spec)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = support
    _spec.loader.exec_module(support)

RECIPES = support.REPO / "launch"
SCRIPTS = support.SCRIPTS
SHELL_RECIPES = ["torchrun_multinode.sh", "mpirun_hostfile.sh", "slurm.sbatch"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", SHELL_RECIPES)
def test_shell_recipes_are_valid_bash(name: str) -> None:
    path = RECIPES / name
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n# ")  # commented from the top
    assert re.search(r"examples/train_(gpt|cnn)\.py", text)  # the examples, unchanged
    assert os.access(path, os.X_OK)


@pytest.mark.timeout(90)
def test_torchrun_recipe_runs_one_node_for_real(tmp_path: Path) -> None:
    result = support.run(
        ["bash", str(RECIPES / "torchrun_multinode.sh"), "--lr", "0.5"],
        timeout=80,
        env_extra={
            "NNODES": "1",
            "NODE_RANK": "0",
            "NPROC_PER_NODE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "TRAIN_SCRIPT": str(SCRIPTS / "allreduce.py"),
            "PET_LOG_DIR": str(tmp_path),  # torchrun's --log-dir, else it litters /tmp
        },
    )
    assert result.returncode == 0, result.output
    ranks = support.rank_lines(result.stdout)
    assert sorted(ranks) == [0, 1] and all(f["sum"] == "3" for f in ranks.values())
    assert "args=['--lr', '0.5']" in result.stdout
    cpus = len(os.sched_getaffinity(0))
    assert all(f["omp"] == str(max(1, cpus // 2)) for f in ranks.values())


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or not support.MPIEXEC.exists(),
    reason="needs mpi4py and the mpiexec of the mpich wheel",
)
def test_mpirun_recipe_runs_on_localhost_for_real(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine only\nlocalhost\n")
    result = support.run(
        ["bash", str(RECIPES / "mpirun_hostfile.sh"), "a b"],
        timeout=50,
        env_extra={
            "HOSTFILE": str(hostfile),
            "NPROC_PER_NODE": "2",
            "PYTHON": sys.executable,
            "MPIEXEC": str(support.MPIEXEC),
            "TRAIN_SCRIPT": str(SCRIPTS / "mpi_ranks.py"),
        },
    )
    assert result.returncode == 0, result.output
    ranks = support.rank_lines(result.stdout)
    assert sorted(ranks) == [0, 1] and all(f["size"] == "2" for f in ranks.values())
    assert result.stdout.count("args=['a b']") == 2


def test_hostfile_example_lists_hosts() -> None:
    lines = (RECIPES / "hostfile.example").read_text().splitlines()
    hosts = [line for line in lines if line.strip() and not line.startswith("#")]
    assert hosts == ["node1", "node2"]


def _fake_tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)


@pytest.mark.timeout(30)
def test_slurm_recipe_expands_to_one_srun(tmp_path: Path) -> None:
    text = (RECIPES / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "4"
    srun_lines = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun_lines) == 1 and "--kill-on-bad-exit=1" in srun_lines[0]

    # Run the batch script with stand-ins for scontrol and srun that record what they get.
    bin_dir, record = tmp_path / "bin", tmp_path / "srun.json"
    bin_dir.mkdir()
    _fake_tool(bin_dir, "scontrol", "import sys; sys.stdout.write('gpu07\\ngpu08\\n')\n")
    _fake_tool(
        bin_dir,
        "srun",
        "import json, os, sys\n"
        "keys = ('MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS', 'MPAR_CONFIG')\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': {{k: os.environ.get(k) for k in keys}}}},"
        f" open({str(record)!r}, 'w'))\n",
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
        "SLURM_CPUS_PER_TASK": "8",
        "MPAR_CONFIG": "/shared/cfg.json",
    }
    env.pop("MASTER_PORT", None)
    subprocess.run(
        ["bash", str(RECIPES / "slurm.sbatch"), "--steps", "3"],
        check=True,
        env=env,
        cwd=support.REPO,
        timeout=20,
    )
    seen = json.loads(record.read_text())
    assert seen["argv"] == [
        "--kill-on-bad-exit=1",
        "--cpu-bind=cores",
        "python",
        "-u",
        "examples/train_gpt.py",
        "--steps",
        "3",
    ]
    assert seen["env"] == {
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 123456 % 20000),
        "OMP_NUM_THREADS": "8",
        "MPAR_CONFIG": "/shared/cfg.json",
    }


def test_kubeflow_pytorchjob() -> None:
    job = yaml.safe_load((RECIPES / "kubeflow_pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1
    pods = sum(spec["replicas"] for spec in specs.values())
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"
        command = container["command"]
        assert command[:2] == ["bash", "-c"]
        words = shlex.split(command[2])
        assert words[0] == "torchrun" and words[-1] == "examples/train_gpt.py"
        options = dict(word.split("=", 1) for word in words[1:-1])
        assert options["--nnodes"] == str(pods)  # one node per pod
        assert options["--node-rank"] == "$RANK"  # set by the operator (shlex keeps it)
        assert options["--master-addr"] == "$MASTER_ADDR"
        env = {item["name"]: item["value"] for item in container["env"]}
        assert env["MPAR_CONFIG"].startswith("/etc/mpar/")
