"""Configuration boundary: keys, aliases, types, ranges, combinations."""

from __future__ import annotations

import json

import pytest

import mpar
from mpar.config import ACCEPTED_KEYS, Config, ZeroConfig, config_from_dict, load_config
from mpar.errors import ConfigError, ConfigTypeError


def test_accepted_keys_are_frozen():
    # Changing this set changes the public contract (DESIGN.md): update docs too.
    assert ACCEPTED_KEYS == {
        "pipeline_parallel_degree",
        "partitions",
        "microbatches",
        "pipeline",
        "virtual_stages",
        "active_microbatches",
        "split_backward",
        "optimize",
        "memory_weight",
        "auto_partition",
        "default_partition",
        "placement_strategy",
        "ddp",
        "zero",
        "activation_checkpointing",
        "offload_activations",
        "bf16",
        "fp16",
        "device",
        "backend",
        "seed",
        "timeout_s",
        "shared_memory",
        "nccl_rules",
        "grad_reduce_dtype",
        "trace",
        "device_memory",
        "shard_optimizer_state",
        "zero_optimization",
        "tensor_parallel_degree",
        "tp",
        "tp_plan",
        "expert_parallel_degree",
        "ep",
        "ep_plan",
        "context_parallel_degree",
        "cp",
        "context_parallel_method",
    }


def test_defaults():
    cfg = config_from_dict({})
    assert cfg == Config()
    assert cfg.pipeline == "interleaved" and cfg.microbatches == 1
    assert cfg.resolved_memory_weight == 0.2
    assert config_from_dict({"optimize": "memory"}).resolved_memory_weight == 0.8


def test_init_typo_suggests_key():
    with pytest.raises(ValueError, match="microbatchez") as info:
        mpar.init({"pipeline_parallel_degree": 2, "microbatchez": 4})
    assert "did you mean 'microbatches'" in str(info.value)
    assert not mpar.is_initialized()


def test_unknown_nested_key():
    with pytest.raises(ConfigError, match="'stge'.*did you mean 'stage'"):
        config_from_dict({"zero": {"stge": 1}})


@pytest.mark.parametrize(
    ("raw", "error", "fragment"),
    [
        ({"microbatches": "4"}, ConfigTypeError, "'microbatches' must be an integer"),
        ({"microbatches": True}, ConfigTypeError, "'microbatches' must be an integer"),
        ({"microbatches": 0}, ConfigError, "'microbatches' has value 0"),
        (
            {"pipeline": "gpipe"},
            ConfigError,
            "'pipeline' has value 'gpipe' [(]did you mean 'simple'",
        ),
        ({"memory_weight": 1.5}, ConfigError, "in \\[0, 1\\]"),
        ({"ddp": "yes"}, ConfigTypeError, "'ddp' must be true or false"),
        ({"zero": {"stage": 4}}, ConfigError, "'zero.stage' has value 4"),
        ({"zero": 3}, ConfigTypeError, "'zero' must be a mapping"),
        (
            {"zero": {"stage": 3, "reshard_after_forward": "no"}},
            ConfigTypeError,
            "'zero.reshard_after_forward' must be true or false",
        ),
        ({"bf16": True, "fp16": True}, ConfigError, "'bf16' and 'fp16' are both true"),
        ({"zero": {"offload_params": "cpu"}}, ConfigError, "needs ZeRO stage 3"),
        ({"zero": {"offload_optimizer": "cpu"}}, ConfigError, "needs ZeRO stage 1, 2 or 3"),
        ({"offload_activations": True}, ConfigError, "turn checkpointing on"),
        ({"microbatches": 2, "active_microbatches": 3}, ConfigError, "only 2 microbatches"),
        (
            {"partitions": 2, "virtual_stages": 2, "microbatches": 4, "active_microbatches": 2},
            ConfigError,
            "must hold 3 .* use active_microbatches >= 3",
        ),
        (
            {
                "pipeline": "simple",
                "virtual_stages": 2,
                "microbatches": 4,
                "active_microbatches": 1,
            },
            ConfigError,
            "simple schedule .* must hold 2",
        ),
        ({"default_partition": 2, "partitions": 2}, ConfigError, "only 2 stages"),
        ({"device": "cpu", "backend": "nccl"}, ConfigError, "NCCL needs CUDA"),
        (
            {"partitions": 4, "virtual_stages": 2, "microbatches": 6},
            ConfigError,
            "multiple of pipeline_parallel_degree 4; use 4 or 8",
        ),
        ({"partitions": 2, "pipeline_parallel_degree": 2}, ConfigError, "alias 'partitions'"),
        ({"timeout_s": float("nan")}, ConfigError, "'timeout_s' is nan; it must be a finite"),
        ({"timeout_s": float("inf")}, ConfigError, "'timeout_s' is inf; it must be a finite"),
        ({"timeout_s": -float("inf")}, ConfigError, "'timeout_s' is -inf"),
        ({"timeout_s": 0}, ConfigError, "'timeout_s' is 0; it must be a finite number"),
        ({"timeout_s": 1e300}, ConfigError, "'timeout_s' is 1e\\+300; .* <= 1e\\+09"),
        ({"timeout_s": "60"}, ConfigTypeError, "'timeout_s' must be a number"),
        ({"trace": 3}, ConfigTypeError, "'trace' must be a directory path"),
        ({"trace": " "}, ConfigError, "'trace' is an empty path"),
    ],
)
def test_bad_values_name_key_and_fix(raw, error, fragment):
    with pytest.raises(error, match=fragment):
        config_from_dict(raw)


def test_timeout_from_json_nan_is_a_config_error(tmp_path):
    # json.loads accepts NaN and Infinity, so a file can carry them
    path = tmp_path / "cfg.json"
    path.write_text('{"timeout_s": NaN}')
    with pytest.raises(ConfigError, match="'timeout_s' is nan"):
        load_config(path)


def test_trace_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MPAR_TRACE", str(tmp_path))
    assert load_config({}).trace == str(tmp_path)
    assert load_config(Config()).trace == str(tmp_path)
    assert load_config({"trace": "elsewhere"}).trace == "elsewhere"
    assert config_from_dict({}).trace is None  # only load_config (mpar.init) reads it
    monkeypatch.delenv("MPAR_TRACE")
    assert config_from_dict({"trace": tmp_path}).trace == str(tmp_path)
    assert load_config({}).trace is None


def test_split_backward_key_and_its_env_override(monkeypatch):
    monkeypatch.delenv("MPAR_SPLIT_BACKWARD", raising=False)
    assert load_config({}).split_backward is True
    assert load_config({"split_backward": False}).split_backward is False
    with pytest.raises(ConfigTypeError, match="split_backward"):
        load_config({"split_backward": "no"})
    monkeypatch.setenv("MPAR_SPLIT_BACKWARD", "0")
    assert load_config({}).split_backward is False
    monkeypatch.setenv("MPAR_SPLIT_BACKWARD", "on")
    assert load_config({"split_backward": False}).split_backward is True
    monkeypatch.setenv("MPAR_SPLIT_BACKWARD", "maybe")
    with pytest.raises(ConfigError, match="MPAR_SPLIT_BACKWARD='maybe'.*0 or 1"):
        load_config({})


def test_world_size_checks():
    cfg = config_from_dict({"pipeline_parallel_degree": 3})
    with pytest.raises(
        ConfigError, match="is 3 but the world size is 4.*must divide.*\\[1, 2, 4\\]"
    ):
        cfg.check_world_size(4)
    cfg.check_world_size(6)
    with pytest.raises(ConfigError, match="'ddp' is false"):
        config_from_dict({"ddp": False, "partitions": 2}).check_world_size(4)
    # a pipeline degree that does not divide the world is named first, whatever tp and cp
    # are (it was a TP hint listing no degree at all: "try a tensor_parallel_degree in []")
    for inner in ({"tp": 2}, {"cp": 2}, {"tp": 2, "cp": 3}):
        with pytest.raises(ConfigError, match=r"is 4 but the world size is 6.*\[1, 2, 3, 6\]"):
            config_from_dict({"partitions": 4, **inner}).check_world_size(6)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree in \[1, 3\]"):
        config_from_dict({"partitions": 2, "tp": 2, "cp": 3}).check_world_size(6)
    with pytest.raises(ConfigError, match=r"context_parallel_degree in \[1, 3\]"):
        config_from_dict({"partitions": 2, "cp": 2}).check_world_size(6)


def test_smp_and_deepspeed_translations():
    assert config_from_dict({"partitions": 4}).pipeline_parallel_degree == 4
    assert config_from_dict({"shard_optimizer_state": True}).zero == ZeroConfig(stage=1)
    assert config_from_dict({"shard_optimizer_state": False}).zero == ZeroConfig()
    ds = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
        "overlap_comm": True,
        "reduce_bucket_size": 2**20,
    }
    zero = config_from_dict({"zero_optimization": ds}).zero
    assert zero == ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu", bucket_mb=4.0)
    with pytest.raises(ConfigError, match="'stgae' in 'zero_optimization'; did you mean 'stage'"):
        config_from_dict({"zero_optimization": {"stgae": 2}})
    with pytest.raises(ConfigError, match="conflicting ZeRO settings"):
        config_from_dict({"zero": {"stage": 2}, "shard_optimizer_state": True})
    with pytest.raises(ConfigError, match="NVMe offload is not supported"):
        config_from_dict({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})


def test_a_whole_deepspeed_json_names_every_key_mpar_does_not_take_with_its_equivalent():
    """Hugging Face's ZeRO-2 example file: one error lists each top-level key mpar does
    not take and what to write instead (it named 'train_batch_size' alone, unknown)."""
    ds = {
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
        "horovod": False,
        "nonsense": 1,
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(ds)
    lines = str(info.value).splitlines()
    assert "10 key(s) mpar does not take" in lines[0]
    want = {
        "optimizer": "(DeepSpeed): build the torch optimizer yourself",
        "scheduler": "torch.optim.lr_scheduler on the DistributedOptimizer",
        "gradient_accumulation_steps": "use 'microbatches'",
        "gradient_clipping": "call optimizer.clip_grad_norm_(max_norm)",
        "steps_per_print": "mpar prints nothing on its own",
        "train_batch_size": "mpar takes no batch sizes",
        "train_micro_batch_size_per_gpu": "mpar takes no batch sizes",
        "wall_clock_breakdown": "set 'trace'",
        "horovod": "(SageMaker model parallelism): mpar has no Horovod mode",
        "nonsense": "not an mpar key",
    }
    assert len(lines) == 1 + len(want)
    for key, advice in want.items():
        assert any(line.startswith(f"  {key!r}") and advice in line for line in lines), key
    # what is left once they are removed is mpar configuration: fp16 and ZeRO-2
    kept = config_from_dict({k: v for k, v in ds.items() if k in ("fp16", "zero_optimization")})
    assert kept.fp16 and not kept.bf16 and kept.zero == ZeroConfig(stage=2)
    # a lone typo still gets its suggestion
    with pytest.raises(ConfigError, match="unknown config key 'microbatchez'; did you mean"):
        config_from_dict({"microbatchez": 4})


def test_a_sagemaker_model_parallel_dict_names_its_keys_mpar_does_not_take():
    smp = {
        "partitions": 2,
        "microbatches": 4,
        "pipeline": "interleaved",
        "placement_strategy": "spread",
        "optimize": "speed",
        "ddp": True,
        "auto_partition": True,
        "default_partition": 0,
        "active_microbatches": 2,
        "tensor_parallel_degree": 1,
        "sharded_data_parallel_degree": 2,
        "delayed_parameter_initialization": True,
        "fp16_params": True,
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(smp)
    message = str(info.value)
    assert "3 key(s) mpar does not take" in message
    assert "'sharded_data_parallel_degree' (SageMaker model parallelism): " in message
    assert "'zero': {'stage': 3}" in message and "meta device" in message
    assert "'fp16_params' (SageMaker model parallelism): use 'fp16': true" in message
    with pytest.raises(ConfigError, match="'parameters' dict itself") as info:
        config_from_dict({"enabled": True, "parameters": smp})  # the estimator's wrapper
    assert "'enabled' (SageMaker model parallelism): leave it out" in str(info.value)
    rest = {k: v for k, v in smp.items() if k in ACCEPTED_KEYS}
    cfg = config_from_dict(rest)
    assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.active_microbatches) == (2, 4, 2)


def test_deepspeed_precision_sections_translate_only_what_mpar_does():
    """{"enabled": ...} is the flag, with the fp16 settings that are mpar's own (dynamic
    scaling from 2^16, doubled after 2000 finite steps); a static loss scale, DeepSpeed's
    hysteresis or floor, or HF's "auto" would not be honoured, so they are refused."""
    assert config_from_dict({"bf16": {"enabled": True}}).bf16 is True
    assert config_from_dict({"bf16": {"enabled": False}}).bf16 is False
    same = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 1}
    cfg = config_from_dict({"fp16": {**same, "loss_scale_window": 2000}})
    assert cfg.fp16 is True and str(cfg.precision) == str(
        config_from_dict({"fp16": True}).precision
    )
    with pytest.raises(ConfigError, match=r"'fp16.loss_scale' = 128 \(a static loss scale\)"):
        config_from_dict({"fp16": {"enabled": True, "loss_scale": 128}})
    hf = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2}
    with pytest.raises(ConfigError) as info:
        config_from_dict({"fp16": {**hf, "min_loss_scale": 1}})
    message = str(info.value)
    assert "'fp16.enabled' is 'auto'" in message and "write true or false" in message
    assert (
        "'fp16.loss_scale_window' = 1000, 'fp16.hysteresis' = 2, 'fp16.min_loss_scale' = 1"
        in message
    )
    assert "'fp16.loss_scale' =" not in message  # 0 is mpar's dynamic scaling
    with pytest.raises(ConfigError, match="'bf16.enabled' is 'auto'"):
        config_from_dict({"bf16": {"enabled": "auto"}})
    with pytest.raises(ConfigError, match="'bf16.immediate_grad_update' = True cannot be"):
        config_from_dict({"bf16": {"enabled": True, "immediate_grad_update": True}})


def test_deepspeed_pipeline_and_checkpointing_sections_say_what_mpar_calls_them():
    section = {"stages": 2, "partition_method": "parameters", "activation_checkpoint_interval": 1}
    with pytest.raises(ConfigError, match="'stages' as 'pipeline_parallel_degree'"):
        config_from_dict({"pipeline": section})
    ds = {"partition_activations": False, "cpu_checkpointing": True, "number_checkpoints": None}
    with pytest.raises(ConfigError, match="'cpu_checkpointing' is 'offload_activations'"):
        config_from_dict({"activation_checkpointing": ds})
    with pytest.raises(ConfigError, match="'evry' in 'activation_checkpointing'"):
        config_from_dict({"activation_checkpointing": {"mode": "block", "evry": 2}})


def test_a_deepspeed_zero3_section_as_hugging_face_writes_it_pastes_unchanged():
    # the ZeRO-3 section of Hugging Face's DeepSpeed integration docs, "auto" values included
    ds = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "zero_quantized_weights": False,
    }
    zero = config_from_dict({"zero_optimization": ds}).zero
    assert zero == ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu")
    legacy = config_from_dict({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero
    assert legacy == ZeroConfig(stage=2, offload_optimizer="cpu")


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"zero_quantized_gradients": True}, "'zero_optimization.zero_quantized_gradients'"),
        ({"zero_hpz_partition_size": 8}, "no such feature"),
        ({"mics_shard_size": 8}, "set it to -1"),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}}, "offloads all of it"),
        ({"offload_optimizer": {"device": "cpu", "pin_memroy": True}}, "did you mean 'pin_memory'"),
        ({"reduce_bucket_size": "big"}, 'or "auto"'),
        ({"cpu_offload": "yes"}, "'zero_optimization.cpu_offload' must be true or false"),
    ],
)
def test_deepspeed_features_mpar_lacks_are_refused_by_name(section, match):
    with pytest.raises((ConfigError, ConfigTypeError), match=match):
        config_from_dict({"zero_optimization": {"stage": 3, **section}})


def test_files_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"partitions": 2, "microbatches": 8}))
    assert load_config(str(path)).microbatches == 8
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text("pipeline: simple\nzero:\n  stage: 2\n")
    cfg = load_config(yaml_path)
    assert cfg.pipeline == "simple" and cfg.zero.stage == 2
    monkeypatch.setenv("MPAR_CONFIG", str(yaml_path))
    assert load_config(None).zero.stage == 2
    monkeypatch.setenv("MPAR_CONFIG", '{"microbatches": 3}')
    assert load_config(None).microbatches == 3
    monkeypatch.delenv("MPAR_CONFIG")
    assert load_config(None) == Config()
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(ConfigTypeError, match="takes a dict"):
        load_config(42)  # type: ignore[arg-type]


def test_to_dict_round_trip():
    cfg = config_from_dict({"partitions": 2, "zero": {"stage": 2}, "microbatches": 4})
    assert config_from_dict(cfg.to_dict()) == cfg


def test_a_pipeline_started_as_one_process_is_told_how_to_launch(monkeypatch):
    """`python train.py` with {"pipeline_parallel_degree": 2}: before, only "the pipeline
    degree must divide the world size (try one of [1])"; now also how to start it."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MV2_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)  # fmt: skip
    monkeypatch.delenv("MPAR_CONFIG", raising=False)
    with pytest.raises(ConfigError, match=r"world size is 1.*mpar launch --nproc-per-node 4 "):
        mpar.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2})
    assert not mpar.is_initialized()


def test_a_backend_this_torch_lacks_is_a_config_error(monkeypatch):
    """Before: torch's RuntimeError "Distributed package doesn't have MPI built in" (or
    NCCL, with device 'auto' on a CPU-only host) from inside init_process_group."""
    import torch
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "MPAR_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    if not dist.is_mpi_available():
        with pytest.raises(ConfigError, match=r"'backend' is 'mpi' but this torch build has no"):
            mpar.init({"backend": "mpi"})
    if not torch.cuda.is_available():
        # a CPU build has no NCCL at all; a CUDA build without a GPU has no CUDA device
        with pytest.raises(ConfigError, match=r"'backend' is 'nccl' but (this torch|the dev)"):
            mpar.init({"backend": "nccl"})
    assert not mpar.is_initialized()


@pytest.mark.parametrize("key", ["bf16", "fp16"])
def test_mixed_precision_keys_start_mpar(key):
    assert getattr(config_from_dict({key: True}), key)
    try:
        assert getattr(mpar.init({key: True}), key)
    finally:
        mpar.shutdown()


def test_grad_reduce_dtype_is_fp32_or_the_compute_dtype():
    assert Config().grad_reduce_dtype == "fp32"
    assert not config_from_dict({"bf16": True}).low_precision_grads
    low = config_from_dict({"bf16": True, "grad_reduce_dtype": "bf16"})
    assert low.low_precision_grads
    assert config_from_dict({"fp16": True, "grad_reduce_dtype": "fp16"}).low_precision_grads
    with pytest.raises(ConfigError, match="precision is 'bf16'.*'fp32' or 'bf16'"):
        config_from_dict({"bf16": True, "grad_reduce_dtype": "fp16"})
    with pytest.raises(ConfigError, match="precision is 'fp32'.*set 'bf16': true") as fp32:
        config_from_dict({"grad_reduce_dtype": "bf16"})
    assert "to 'fp32', or set 'bf16': true" in str(fp32.value)  # (not "'fp32' or 'fp32'")
    with pytest.raises(ConfigError, match="allowed: 'fp32', 'bf16', 'fp16'"):
        config_from_dict({"bf16": True, "grad_reduce_dtype": "float32"})


@pytest.mark.parametrize("size", [float("nan"), float("inf"), -1.0, 0])
def test_bucket_size_must_be_a_finite_positive_size(size):
    # once passed here: NaN then failed the cross-rank check (nan != nan), inf the sharding
    with pytest.raises(ConfigError, match=r"'zero.bucket_mb' is .*finite number of MiB > 0"):
        config_from_dict({"zero": {"stage": 2, "bucket_mb": size}})


def test_auto_values_need_device_memory_and_hold_placeholders():
    cfg = load_config(
        {
            "microbatches": "auto",
            "virtual_stages": "auto",
            "zero": {"stage": "auto", "offload_optimizer": "cpu"},
            "activation_checkpointing": "auto",
            "device_memory": "16GiB",
        }
    )
    assert set(cfg.auto_keys) == {
        "microbatches",
        "virtual_stages",
        "zero.stage",
        "activation_checkpointing",
    }
    assert cfg.zero.stage == 1  # the smallest stage its offload setting allows, until resolved
    assert load_config(cfg.to_dict()) == cfg  # unresolved keys round-trip as "auto"
    with pytest.raises(ConfigError, match="device_memory"):
        load_config({"microbatches": "auto", "device": "cpu"})
    pp_auto = load_config({"pipeline_parallel_degree": "auto", "device_memory": "16GiB"})
    with pytest.raises(ConfigError, match="mpar plan --auto"):
        pp_auto.check_world_size(4)
    with pytest.raises(ConfigError, match="device_memory"):
        load_config({"device_memory": "lots"})
    with pytest.raises(ConfigTypeError, match="microbatches"):
        load_config({"microbatches": "many", "device_memory": "16GiB"})


def test_init_dict_and_launch_config_are_merged(tmp_path, monkeypatch):
    """`mpar launch --config` (MPAR_CONFIG) and a dict or file given to mpar.init: merged
    key by key; a key both give must agree; a typo in the launch file is reported."""
    launched = tmp_path / "launch.json"
    launched.write_text(json.dumps({"microbatches": 4, "zero": {"stage": 2}}))
    monkeypatch.setenv("MPAR_CONFIG", str(launched))
    cfg = load_config({"partitions": 2, "zero": {"bucket_mb": 8}})
    assert (cfg.pipeline_parallel_degree, cfg.microbatches) == (2, 4)
    assert (cfg.zero.stage, cfg.zero.bucket_mb) == (2, 8)
    assert load_config({"microbatches": 4}).microbatches == 4  # the same value: fine
    with pytest.raises(
        ConfigError,
        match=r"'microbatches' is 8 in the dict given to mpar.init but 4 in MPAR_CONFIG",
    ):
        load_config({"microbatches": 8})
    # the section is named: 'zero.stage' (before: 'stage', which is no top-level key)
    with pytest.raises(ConfigError, match=r"'zero.stage' is 3 in the dict .* but 2 in MPAR_"):
        load_config({"zero": {"stage": 3}})
    own = tmp_path / "own.yaml"
    own.write_text("pipeline_parallel_degree: 2\nmicrobatches: 2\n")
    with pytest.raises(ConfigError, match=r"in the config file .*own.yaml"):
        load_config(own)
    launched.write_text(json.dumps({"microbatchez": 4}))
    with pytest.raises(ConfigError, match="unknown config key 'microbatchez'; did you mean"):
        load_config({"partitions": 2})
    monkeypatch.setenv("MPAR_CONFIG", '{"partitions": 2}')  # an alias: its canonical key
    assert load_config({"pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2
    with pytest.raises(ConfigError, match="'partitions' is 4 in the dict .* but 2 in MPAR_CONFIG"):
        load_config({"partitions": 4})


def test_context_and_expert_parallel_together_are_refused() -> None:
    # each axis alone is accepted
    assert config_from_dict({"context_parallel_degree": 2}).context_parallel_degree == 2
    assert config_from_dict({"expert_parallel_degree": 2}).expert_parallel_degree == 2
    with pytest.raises(ConfigError, match="context_parallel_degree and expert_parallel_degree"):
        config_from_dict({"cp": 2, "ep": 2})
    with pytest.raises(ConfigError, match="not supported yet"):
        config_from_dict({"context_parallel_degree": 4, "expert_parallel_degree": 2})


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("Interleaved", "interleaved"),
        ("gpipe", "simple"),
        ("1F1B", "interleaved"),
        ("ScheduleInterleavedZeroBubble", "zero_bubble"),
        ("ZBV", "zbv"),
    ],
)
def test_a_schedule_spelled_as_elsewhere_names_mpars_spelling(given, meant):
    with pytest.raises(ConfigError, match=f"did you mean '{meant}'.*schedule CSV file"):
        config_from_dict({"pipeline": given})
