"""Keys of SageMaker model parallelism (smp v1) and DeepSpeed configs that mpar does
not take, each with what to write instead.

A user pasting a whole smp ``parameters`` dict or a DeepSpeed JSON meets these; each
is refused by name with its mpar equivalent (a config key, a call in the training
loop, or "nothing to set"), all of them in one error, so that one run lists
everything to change. Nothing here is accepted and ignored: a value mpar would not
honour (a clipping norm, a batch size, a static loss scale) must not look as if it
were.

DeepSpeed's ``fp16`` / ``bf16`` sections are translated where they say exactly what
mpar does (:func:`precision_flag`); its ``zero_optimization`` section is translated
in ``_boundary``.
"""

from __future__ import annotations

from collections.abc import Mapping

from mpar.errors import ConfigError

__all__ = [
    "FOREIGN_KEYS",
    "deepspeed_section_error",
    "foreign_keys_error",
    "precision_flag",
]

_DS, _SMP = "DeepSpeed", "SageMaker model parallelism"
_BATCH = (
    "mpar takes no batch sizes: each data-parallel rank passes its shard of the global "
    "batch to the @mpar.step function, which splits it into 'microbatches'"
)
_LOGGING = (
    "mpar prints nothing on its own: print StepOutput.reduce_mean() where you want; for "
    "timings set 'trace' (per-action timelines, see docs/schedules.md)"
)
_CLIP = (
    "call optimizer.clip_grad_norm_(max_norm) between the step and optimizer.step() "
    "(one norm over every stage and shard)"
)
_SDP = (
    "mpar's ZeRO-3 ('zero': {'stage': 3}) sizes buckets with 'zero.bucket_mb' and decides "
    "gathers and persistence itself"
)

FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    # DeepSpeed's top level
    "train_batch_size": (_DS, _BATCH),
    "train_micro_batch_size_per_gpu": (_DS, _BATCH),
    "gradient_accumulation_steps": (
        _DS,
        "use 'microbatches': the batch given to the @mpar.step function is split into that "
        "many microbatches, whose gradients add up before optimizer.step()",
    ),
    "gradient_clipping": (_DS, _CLIP),
    "optimizer": (
        _DS,
        "build the torch optimizer yourself and wrap it: "
        "mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=...))",
    ),
    "scheduler": (
        _DS,
        "build a torch.optim.lr_scheduler on the DistributedOptimizer (its param_groups "
        "are the optimizer's) and step it yourself",
    ),
    "steps_per_print": (_DS, _LOGGING),
    "wall_clock_breakdown": (_DS, _LOGGING),
    "flops_profiler": (_DS, "profile with `mpar plan` (predicted) or 'trace' (measured)"),
    "prescale_gradients": (_DS, "gradients are averaged over the data-parallel ranks once"),
    "gradient_predivide_factor": (_DS, "gradients are averaged over the data-parallel ranks once"),
    "communication_data_type": (
        _DS,
        "use 'grad_reduce_dtype' ('fp32', or the compute dtype under bf16 / fp16)",
    ),
    "amp": (_DS, "use 'bf16': true or 'fp16': true (mpar's own mixed precision)"),
    "zero_allow_untested_optimizer": (_DS, "any torch optimizer works with every ZeRO stage"),
    "zero_force_ds_cpu_optimizer": (_DS, "the CPU optimizer is the torch optimizer you give"),
    "sparse_gradients": (_DS, "leave it out: mpar reduces gradients dense"),
    "tensorboard": (_DS, _LOGGING),
    "wandb": (_DS, _LOGGING),
    "csv_monitor": (_DS, _LOGGING),
    "comms_logger": (_DS, _LOGGING),
    "checkpoint": (
        _DS,
        "call mpar.save_checkpoint / mpar.load_checkpoint (any layout resumes in any other)",
    ),
    "elasticity": (_DS, "restart with `mpar launch --max-restarts N` and resume a checkpoint"),
    "autotuning": (_DS, "run `mpar plan --auto` and use the config it prints"),
    "tensor_parallel": (_DS, "use 'tensor_parallel_degree' (and 'tp_plan')"),
    "sequence_parallel_size": (
        _DS,
        "use 'context_parallel_degree' with 'context_parallel_method': 'all_to_all' (Ulysses)",
    ),
    # the SageMaker estimator's distribution wrappers around smp's "parameters"
    "smdistributed": (_SMP, "pass the dict at smdistributed.modelparallel.parameters"),
    "modelparallel": (_SMP, "pass the dict at modelparallel.parameters"),
    "parameters": (_SMP, "pass the 'parameters' dict itself (its keys are the config)"),
    "enabled": (_SMP, "leave it out: calling mpar.init enables mpar"),
    "mpi": (_SMP, "start the processes with `mpar launch --mpi` (or mpirun) instead"),
    # smp v1 (model parallelism's "parameters")
    "horovod": (_SMP, "mpar has no Horovod mode: data parallelism is 'ddp' (true by default)"),
    "ddp_port": (_SMP, "the rendezvous port is MASTER_PORT (`mpar launch --master-port`)"),
    "ddp_dist_backend": (_SMP, "use 'backend' ('auto', 'nccl', 'gloo', ...)"),
    "sharded_data_parallel_degree": (
        _SMP,
        "sharded data parallelism is ZeRO-3 over every data-parallel rank of a stage: "
        "'zero': {'stage': 3} (a sharding group smaller than dp is not supported)",
    ),
    "sdp_reduce_bucket_size": (_SMP, _SDP),
    "sdp_param_persistence_threshold": (_SMP, _SDP),
    "sdp_max_live_parameters": (_SMP, _SDP),
    "sdp_hierarchical_allgather": (_SMP, _SDP),
    "sdp_gradient_clipping": (_SMP, _CLIP),
    "delayed_parameter_initialization": (
        _SMP,
        "build the model on the meta device (or pass a zero-argument factory) to "
        "mpar.DistributedModel: each rank materialises only its share (docs/large_models.md)",
    ),
    "fp16_params": (_SMP, "use 'fp16': true (fp16 compute, float32 master weights)"),
    "tensor_parallel_seed": (_SMP, "use 'seed' (the same initialisation in every layout)"),
    "prescaled_batch": (
        _SMP,
        "the ranks of a tensor-parallel group take the same batch (dp = world / (pp x tp)); "
        "there is no prescaled mode",
    ),
    "activation_loading_horizon": (
        _SMP,
        "offloaded activations ('offload_activations') are brought back as their backward "
        "comes; nothing to set",
    ),
    "skip_tracing": (
        _SMP,
        "the model is profiled at the first step; to partition at once pass example_inputs "
        "to mpar.DistributedModel, or place modules yourself with 'auto_partition': false",
    ),
    "predefined_hooks": (_SMP, "Hugging Face models are recognised by their structure"),
    "contiguous": (_SMP, "mpar keeps flat buffers itself; nothing to set"),
}
"""Foreign key -> (where it comes from, what to write in mpar instead)."""


def foreign_keys_error(keys: list[str], others: list[str]) -> ConfigError | None:
    """One error naming every foreign key among ``keys`` with its mpar equivalent (and
    the ``others``, unknown anywhere, by name); None when none of ``keys`` is foreign."""
    known = [k for k in keys if k in FOREIGN_KEYS]
    if not known:
        return None
    lines = [f"  {k!r} ({FOREIGN_KEYS[k][0]}): {FOREIGN_KEYS[k][1]}" for k in known]
    lines += [f"  {k!r}: not an mpar key (see docs/configuration.md)" for k in others]
    return ConfigError(
        f"the config holds {len(known) + len(others)} key(s) mpar does not take; remove them "
        "(DeepSpeed's 'zero_optimization' section and smp's model-parallel keys such as "
        "'partitions' and 'microbatches' are understood):\n" + "\n".join(lines)
    )


_SCALER = (
    "mpar's fp16 loss scaling is dynamic with fixed constants (2^16 at first, halved on an "
    "overflow, doubled after 2000 finite steps; see docs/runtime.md#mixed-precision)"
)


_SAME_AS_MPAR = {("loss_scale", 0), ("initial_scale_power", 16), ("loss_scale_window", 2000)}
_SAME_AS_MPAR |= {("hysteresis", 1)}
"""DeepSpeed's fp16 settings that say what mpar does: dynamic scaling (loss_scale 0) from
2^16, doubled after 2000 finite steps, halved at the first overflow."""


def precision_flag(key: str, section: Mapping[object, object]) -> object:
    """DeepSpeed's ``{"enabled": ...}`` section of ``fp16`` / ``bf16`` as mpar's flag,
    where it asks for exactly what mpar does; else a ConfigError naming every setting
    that says otherwise."""
    same = _SAME_AS_MPAR if key == "fp16" else set()
    other = [(n, v) for n, v in section.items() if n != "enabled" and (n, v) not in same]
    enabled = section.get("enabled", False)
    if enabled != "auto" and not other:
        return enabled
    problems = []
    if enabled == "auto":
        problems.append(
            f"'{key}.enabled' is 'auto', which Hugging Face's Trainer fills in from its own "
            "flags and mpar does not: write true or false"
        )
    if other:
        settings = ", ".join(f"'{key}.{name}' = {value!r}" for name, value in other)
        static = " (a static loss scale)" if any(n == "loss_scale" for n, _ in other) else ""
        why = f": {_SCALER}" if key == "fp16" else ""
        problems.append(f"{settings}{static} cannot be honoured{why}; leave them out")
    raise ConfigError(
        f"config key {key!r} is DeepSpeed's section {dict(section)!r}: "
        + "; ".join(problems)
        + f' (or write "{key}": true / false)'
    )


_DS_CHECKPOINTING = frozenset(
    {
        "partition_activations",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    }
)


def deepspeed_section_error(key: str, value: object) -> ConfigError | None:
    """DeepSpeed's ``pipeline`` or ``activation_checkpointing`` section given where mpar
    has a key of that name with another meaning: what to write instead; else None."""
    if not isinstance(value, Mapping):
        return None
    if key == "pipeline":
        return ConfigError(
            f"config key 'pipeline' is a section {dict(value)!r}, as DeepSpeed writes it; "
            "in mpar 'pipeline' names the schedule ('interleaved', 'simple', 'zero_bubble', "
            "'zbv' or a schedule CSV). Write DeepSpeed's 'stages' as "
            "'pipeline_parallel_degree'; 'partition_method' has no equivalent (mpar "
            "partitions from a profile: 'optimize', 'memory_weight'; by hand: "
            "'auto_partition': false); 'activation_checkpoint_interval' as "
            "'activation_checkpointing': 'block' (each block recomputed alone) or true (each "
            "stage recomputed whole)"
        )
    if key == "activation_checkpointing" and _DS_CHECKPOINTING & set(value):
        return ConfigError(
            f"config key 'activation_checkpointing' is DeepSpeed's section {dict(value)!r}, "
            "which tunes deepspeed.checkpointing calls in the model; in mpar the key turns "
            "recomputation on: true, 'block', 'selective' or {'mode': 'block', 'every': k} "
            "(see docs/runtime.md#activation-checkpointing); 'cpu_checkpointing' is "
            "'offload_activations': true; the other settings have no equivalent"
        )
    return None
