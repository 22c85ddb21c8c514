"""The examples, shortened, under ``mpar launch`` (as the README runs them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _launch(nproc: int, config: str, script: str, *args: str, timeout: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [
        sys.executable,
        "-m",
        "mpar.launch",
        "--nproc-per-node",
        str(nproc),
        "--config",
        str(ROOT / "examples/configs" / config),
        str(ROOT / "examples" / script),
        *args,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _final_loss(out: str) -> float:
    found = re.findall(r"final loss ([0-9.]+)", out)
    assert found, out[-2000:]
    return float(found[-1])


@pytest.mark.timeout(180)
def test_gpt_example_trains_under_mpar_launch():
    out = _launch(4, "gpt_pp2_dp2.json", "train_gpt.py", "--steps", "20", timeout=170)
    assert "pp=2 dp=2" in out
    assert "pipeline plan: 2 ranks" in out
    assert _final_loss(out) < 1.0, out[-2000:]  # it learns the counting task


@pytest.mark.timeout(120)
def test_cnn_example_learns_with_the_simple_schedule():
    out = _launch(2, "cnn_simple_pp2.json", "train_cnn.py", "--steps", "25", timeout=110)
    assert "pipeline plan: 2 ranks" in out and "simple" in out
    accuracy = float(re.findall(r"held-out accuracy ([0-9.]+)%", out)[-1])
    assert accuracy >= 75.0, out[-2000:]


@pytest.mark.slow  # 20 s; bf16 x ZeRO is in the default mixed-precision grid
@pytest.mark.timeout(240)
def test_llama_example_bf16_zero2_loss_falls():
    pytest.importorskip("transformers")
    out = _launch(4, "llama_bf16_zero2_pp2_dp2.json", "train_llama.py", "--steps", "8", timeout=230)
    assert "pp=2 dp=2" in out
    assert _final_loss(out) < 4.0, out[-2000:]  # from about 4.9 (ln 128) at the start


@pytest.mark.slow  # 21 s; TP plans are in the default tensor-parallel grid
@pytest.mark.timeout(240)
def test_llama_example_tensor_parallel_with_its_own_plan():
    pytest.importorskip("transformers")
    out = _launch(4, "llama_tp2_pp2.json", "train_llama.py", "--steps", "8", timeout=230)
    assert "pp=2 dp=1 tp=2" in out
    assert _final_loss(out) < 4.6, out[-2000:]  # from about 4.9 (ln 128) at the start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bert_example_zero3_offload_learns():
    pytest.importorskip("transformers")
    out = _launch(4, "bert_zero3_offload.json", "finetune_bert.py", "--steps", "30", timeout=290)
    accuracy = float(re.findall(r"held-out accuracy ([0-9.]+)%", out)[-1])
    assert accuracy >= 90.0, out[-2000:]


@pytest.mark.timeout(300)
def test_finetune_pretrained_example_round_trips_through_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = _launch(
        4,
        "llama_zero3_pp2_dp2.json",
        "finetune_pretrained.py",
        "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--steps", "4",
        timeout=290,
    )  # fmt: skip
    first = float(re.findall(r"first loss ([0-9.]+)", out)[-1])
    assert _final_loss(out) < first, out[-2000:]
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) >= 2
    _, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.slow  # the context-parallel grid is in tests/multiproc/test_context_parallel.py
@pytest.mark.timeout(300)
def test_long_context_example_splits_each_sequence_and_learns():
    pytest.importorskip("transformers")
    out = _launch(
        2, "llama_cp2.json", "finetune_long_context.py", "--steps", "12", "--seq", "256",
        timeout=290,
    )  # fmt: skip
    assert "cp=2 (ring), 256 tokens per sequence, 128 per rank" in out
    assert _final_loss(out) < 4.6, out[-2000:]  # below ln(128): it learns to count
