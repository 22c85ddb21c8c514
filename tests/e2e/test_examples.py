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


def _write_checkpoint(path: Path):
    """A Hugging Face checkpoint of a shape the example does not know (its config.json
    is all it learns it from), written by transformers, sharded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100KB")
    return config


@pytest.mark.timeout(300)
def test_finetune_pretrained_example_round_trips_through_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = _write_checkpoint(tmp_path / "ckpt")
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) >= 2
    out = _launch(
        4,
        "llama_zero3_pp2_dp2.json",
        "finetune_pretrained.py",
        "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--steps", "4",
        timeout=290,
    )  # fmt: skip
    first = float(re.findall(r"first loss ([0-9.]+)", out)[-1])
    assert _final_loss(out) < first, out[-2000:]
    tuned, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = tuned.config
    assert (got.hidden_size, got.num_hidden_layers, got.vocab_size) == (64, 3, 96)
    assert got.num_key_value_heads == config.num_key_value_heads


@pytest.mark.timeout(120)
def test_finetune_pretrained_example_without_a_checkpoint_says_how_to_make_one(tmp_path):
    pytest.importorskip("transformers")
    script = [sys.executable, str(ROOT / "examples/finetune_pretrained.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MPAR_CONFIG", None)
    missing = subprocess.run(
        script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2, missing.stderr
    assert (
        "--checkpoint DIR is required" in missing.stderr and "--make-checkpoint" in missing.stderr
    )
    assert not list(tmp_path.iterdir())  # nothing written anywhere quietly
    made = tmp_path / "llama-small"
    done = subprocess.run([*script, "--make-checkpoint", str(made)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (made / "config.json").is_file() and list(made.glob("model-*.safetensors"))


@pytest.mark.slow  # 40 s; expert parallelism's transparency is in the multiproc suite
@pytest.mark.timeout(300)
def test_finetune_mixtral_example_ep2_pp2_round_trips_through_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = _launch(
        4,
        "mixtral_ep2_pp2.json",
        "finetune_mixtral.py",
        "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--steps", "6",
        timeout=290,
    )  # fmt: skip
    assert "ep=2: 4 experts of 8" in out
    first = float(re.findall(r"first loss ([0-9.]+)", out)[-1])
    assert _final_loss(out) < first, out[-2000:]
    _, info = transformers.MixtralForCausalLM.from_pretrained(
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


def _example(name: str):
    """An example script as a module (its folder on sys.path, as ``python script`` has it)."""
    import importlib

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.mark.parametrize(
    "script", ["train_gpt", "train_cnn", "train_llama", "finetune_bert", "finetune_long_context",
               "finetune_mixtral", "finetune_pretrained"],
)  # fmt: skip
@pytest.mark.parametrize("flag", ["--steps", "--batch"])
def test_example_refuses_a_count_below_one_before_starting(script, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _example(script).main([flag, "0"])  # --steps 0 used to print "final loss nan", exit 0
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_long_context_rows_shorter_than_64_tokens_pack_documents():
    import torch

    # --seq 48 raised in torch.randint (documents of 32 to seq // 2 tokens)
    batch = next(_example("finetune_long_context").packed_batches(128, 48, 2, seed=0))
    assert batch["input_ids"].shape == (2, 48)
    starts = batch["position_ids"] == 0
    assert starts.sum(1).min() >= 2  # at least two documents in each row
    assert torch.equal(batch["labels"][starts], torch.full_like(batch["labels"][starts], -100))
