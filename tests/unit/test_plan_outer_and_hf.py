"""Parameters outside every unit in plans, and ``mpar plan --hf-config``."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from mpar.cli import _plan
from mpar.config import config_from_dict
from mpar.partition import make_plan, plan_inputs
from mpar.profile import profile_model


class RootParams(nn.Module):
    """A position table and an output scale on the root module, and an unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.pos = nn.Parameter(torch.randn(8, 16))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.ones(()))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.scale


@pytest.mark.parametrize("mode", ["measure", "meta"])
def test_parameters_outside_units_go_with_their_first_consumer(mode):
    if mode == "meta":
        with torch.device("meta"):
            model = RootParams()
    else:
        model = RootParams()
    prof = profile_model(model, (torch.randint(0, 32, (2, 8)),), mode=mode, repeats=1, warmup=0)
    by_name = {u.name: u for u in prof.units}
    assert by_name["blocks.0"].outer_params == ["pos"]  # the add feeds blocks.0, not embed
    assert by_name["head"].outer_params == ["scale", "unused"]
    assert by_name["blocks.0"].param_count == 16 * 16 + 16 + 8 * 16
    assert sum(u.param_count for u in prof.units) == prof.param_count
    assert prof.unassigned_param_count == 0
    run = plan_inputs(config_from_dict({"partitions": 2, "microbatches": 2}), 2, device="cuda")
    plan = make_plan(prof, run)
    assert sum(s.param_count for s in plan.stages) == sum(p.numel() for p in model.parameters())
    holder = next(st for st in plan.stages if "blocks.0" in st.units)
    assert "pos" in holder.outer_params
    held = ", ".join(holder.outer_params)
    assert f"stage {holder.stage} also holds {held} (outside every unit)" in str(plan)


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    _plan.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_cli_plan_json_counts_root_parameters(tmp_path, monkeypatch, capsys):
    (tmp_path / "root_params_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            from tests.unit.test_plan_outer_and_hf import RootParams

            def make():
                return RootParams(), torch.randint(0, 32, (2, 8))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    assert _run_cli(["--model", "root_params_mod:make", "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sum(s["param_count"] for s in data["stages"]) == sum(
        p.numel() for p in RootParams().parameters()
    )
    assert [p for s in data["stages"] for p in s["outer_params"]] == ["pos", "scale", "unused"]
    monkeypatch.delitem(sys.modules, "root_params_mod", raising=False)


def _llama_7b_config(path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(str(path))
    return path


def test_cli_plan_hf_config_llama_7b(tmp_path, monkeypatch, capsys):
    _llama_7b_config(tmp_path / "config.json")
    (tmp_path / "pp8.json").write_text(json.dumps({"pipeline_parallel_degree": 8}))
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    common = ["--config", str(tmp_path / "pp8.json"), "--world-size", "16"]
    assert _run_cli(["--hf-config", str(tmp_path), "--seq-len", "2048", *common, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == 8
    assert sum(s["param_count"] for s in data["stages"]) == 6_738_415_616
    assert data["stages"][0]["units"][0] == "model.embed_tokens"
    assert data["stages"][-1]["units"][-1] == "lm_head"


def test_cli_plan_hf_config_errors(tmp_path, capsys):
    pytest.importorskip("transformers")
    common = ["--world-size", "2"]
    assert _run_cli(["--hf-config", str(tmp_path / "missing.json"), *common]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    assert _run_cli(["--hf-config", str(bad), *common]) == 2
    assert "model_type" in capsys.readouterr().err
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"model_type": "gpt2", "n_positions": 16, "n_layer": 2}))
    assert _run_cli(["--hf-config", str(small), "--seq-len", "64", *common]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --model and --hf-config exclude each other
        _run_cli(["--hf-config", str(small), "--model", "a:b", *common])


@pytest.mark.parametrize("family", ["bert", "vit", "t5"])
def test_cli_plan_hf_config_other_heads(tmp_path, capsys, family):
    transformers = pytest.importorskip("transformers")
    config = {
        "bert": lambda: transformers.BertConfig(num_hidden_layers=2, num_labels=3),
        "vit": lambda: transformers.ViTConfig(num_hidden_layers=2, image_size=32),
        "t5": lambda: transformers.T5Config(num_layers=2, decoder_start_token_id=0),
    }[family]()
    config.architectures = {
        "bert": ["BertForSequenceClassification"],
        "vit": ["ViTForImageClassification"],
        "t5": ["T5ForConditionalGeneration"],
    }[family]
    config.to_json_file(str(tmp_path / "config.json"))
    argv = ["--hf-config", str(tmp_path), "--seq-len", "32", "--world-size", "2", "--json"]
    assert _run_cli(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    assert sum(s["param_count"] for s in data["stages"]) == sum(
        p.numel() for p in model.parameters()
    )


def _check_auto_output(data, world, memory, batch):
    """The shape of ``mpar plan --auto --json``: a runnable config and its prediction."""
    from mpar.config import load_config

    assert set(data) >= {"config", "predicted", "candidates", "rejected", "evaluated", "plan"}
    config = load_config(data["config"])
    config.check_world_size(world)
    assert data["predicted"]["max_rank_memory_bytes"] <= memory
    assert len(data["predicted"]["rank_memory_bytes"]) == config.pipeline_parallel_degree
    assert data["predicted"]["step_time_s"] > 0
    best = data["candidates"][0]
    dp = world // config.pipeline_parallel_degree
    assert best["microbatch_size"] * config.microbatches * dp == batch
    assert data["plan"]["step_time_s"] == pytest.approx(data["predicted"]["step_time_s"])
    assert all(isinstance(n, int) and n > 0 for n in data["rejected"].values())


def test_cli_plan_auto_hf_config_small_llama(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(str(tmp_path / "config.json"))
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    argv = ["--auto", "--hf-config", str(tmp_path), "--seq-len", "32", "--world-size", "2"]
    argv += ["--no-offload", "--max-virtual-stages", "1", "--device-memory", "20MiB"]
    assert _run_cli([*argv, "--global-batch", "8", "--json"]) == 0
    _check_auto_output(json.loads(capsys.readouterr().out), 2, 20 * 2**20, 8)
    # the process's own memory counts: 19 MiB of it leaves too little for any layout
    assert _run_cli([*argv, "--global-batch", "8", "--process-memory", "19MiB"]) == 2


@pytest.mark.slow
def test_cli_plan_auto_llama_7b_fits_in_under_3_minutes(tmp_path, monkeypatch, capsys):
    """The acceptance case of the auto-planner (docs/planning.md): Llama-7B shape, meta,
    16 ranks x 80 GiB, global batch 64, sequence 4096."""
    import time

    _llama_7b_config(tmp_path / "config.json")
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    argv = ["--auto", "--hf-config", str(tmp_path), "--seq-len", "4096", "--world-size", "16"]
    start = time.monotonic()
    assert _run_cli([*argv, "--device-memory", "80GiB", "--global-batch", "64", "--json"]) == 0
    assert time.monotonic() - start < 180
    _check_auto_output(json.loads(capsys.readouterr().out), 16, 80 * 2**30, 64)
