"""The dict boundary: JSON/YAML files, ``MPAR_CONFIG``, aliases and key checks.

Everything a user may write is translated here into the canonical keys of
:class:`~mpar.config.Config`:

* ``partitions`` -> ``pipeline_parallel_degree`` (smp's name);
* ``shard_optimizer_state: true`` -> ``zero.stage = 1`` (smp);
* a DeepSpeed-style ``zero_optimization`` section (``stage``,
  ``offload_optimizer.device``, ``offload_param.device``,
  ``reduce_bucket_size``, the older ``cpu_offload`` booleans; tuning knobs mpar decides
  itself are accepted and ignored, features it lacks only at their off value) -> ``zero``.

Unknown keys are rejected by name with the closest valid key suggested.

A config given to :func:`load_config` (``mpar.init``'s dict or file) and one in
``MPAR_CONFIG`` (what ``mpar launch --config`` sets) are merged key by key
(:func:`merge_configs`): each key from whichever gives it; a key both give must
have the same value in both (the ``zero`` and ``zero_optimization`` sections are
compared key by key, aliases as their canonical key), else a ``ConfigError``
names the key, both values and both sources. Every key of the merged config is
checked, so a typo in either is reported.

Two environment variables override the config, read once by :func:`load_config`
(``mpar.init``): ``MPAR_TRACE`` gives ``trace`` when the config leaves it out or
null; ``MPAR_SPLIT_BACKWARD`` (``0``/``1``, ``false``/``true``, ``off``/``on``,
``no``/``yes``) sets ``split_backward``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpar.config._foreign import (
    FOREIGN_KEYS,
    deepspeed_section_error,
    foreign_keys_error,
    precision_flag,
)
from mpar.config._schema import BlockCheckpointing, Config, ZeroConfig
from mpar.errors import ConfigError, ConfigTypeError

__all__ = [
    "ACCEPTED_KEYS",
    "AUTO_KEYS",
    "ENV_VAR",
    "SPLIT_BACKWARD_ENV_VAR",
    "TRACE_ENV_VAR",
    "config_from_dict",
    "load_config",
    "merge_configs",
]

ENV_VAR = "MPAR_CONFIG"
TRACE_ENV_VAR = "MPAR_TRACE"
SPLIT_BACKWARD_ENV_VAR = "MPAR_SPLIT_BACKWARD"
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

_CANONICAL = tuple(f.name for f in Config.__dataclass_fields__.values() if f.name != "auto_keys")
#: Keys that accept "auto" (resolved by the planner at the first step; see Config.auto_keys).
AUTO_KEYS = (
    "pipeline_parallel_degree",
    "microbatches",
    "virtual_stages",
    "zero.stage",
    "activation_checkpointing",
)
_ALIASES = {
    "partitions": "pipeline_parallel_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
    "cp": "context_parallel_degree",
}
_TRANSLATED = ("shard_optimizer_state", "zero_optimization")
#: Every top-level key ``mpar.init`` accepts (frozen by a test).
ACCEPTED_KEYS = frozenset(_CANONICAL + tuple(_ALIASES) + _TRANSLATED)

_ZERO_KEYS = tuple(f.name for f in ZeroConfig.__dataclass_fields__.values())
# DeepSpeed tuning knobs that mpar decides itself (it always overlaps communication,
# keeps contiguous flat buckets, sizes prefetch and persistence by partition unit, and
# writes full weights from ``save_pretrained`` without gathering them on one rank): any
# value, "auto" included, is accepted and ignored, so a DeepSpeed section (as Hugging
# Face's examples write it) pastes unchanged.
_DEEPSPEED_IGNORED = frozenset(
    {
        "overlap_comm",
        "contiguous_gradients",
        "allgather_partitions",
        "reduce_scatter",
        "round_robin_gradients",
        "allgather_bucket_size",
        "sub_group_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_module_granularity_threshold",
        "memory_efficient_linear",
        "ignore_unused_parameters",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "use_multi_rank_bucket_allreduce",
        "log_trace_cache_warnings",
        "cpu_offload_use_pin_memory",
    }
)
# DeepSpeed features mpar does not have (quantized ZeRO++ collectives, hierarchical and
# MiCS partitioning): accepted only at the value that turns them off.
_DEEPSPEED_OFF: dict[str, object] = {
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "zero_hpz_partition_size": 1,
    "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False,
}
# DeepSpeed's older spellings of the offload sections (booleans).
_DEEPSPEED_LEGACY = {"cpu_offload": "offload_optimizer", "cpu_offload_params": "offload_params"}
_DEEPSPEED_ZERO_KEYS = (
    frozenset({"stage", "offload_optimizer", "offload_param", "reduce_bucket_size"})
    | _DEEPSPEED_IGNORED
    | frozenset(_DEEPSPEED_OFF)
    | frozenset(_DEEPSPEED_LEGACY)
)
# Keys of DeepSpeed's offload sections: only ``device`` matters to mpar (host copies are
# always pinned on CUDA; the others tune DeepSpeed's NVMe swapper); ``ratio`` (a partial
# optimizer offload) must be 1.
_OFFLOAD_KEYS = (
    "device",
    "pin_memory",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "fast_init",
    "pipeline",
    "pipeline_read",
    "pipeline_write",
    "nvme_path",
    "ratio",
)


def _unknown_key(key: str, where: str, valid: tuple[str, ...] | frozenset[str]) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    options = ", ".join(sorted(valid))
    return ConfigError(f"unknown config key {key!r}{where}{hint} (valid keys: {options})")


def _require_mapping(value: object, key: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigTypeError(
            f"config key {key!r} must be a mapping (dict), got {type(value).__name__} {value!r}"
        )
    return value


def _offload_device(section: object, key: str) -> str:
    if section is None:
        return "none"
    section = _require_mapping(section, key)
    for name in section:
        if name not in _OFFLOAD_KEYS:
            raise _unknown_key(name, f" in {key!r}", _OFFLOAD_KEYS)
    device = section.get("device", "none")
    if device not in ("none", "cpu"):
        raise ConfigError(
            f"config key '{key}.device' has value {device!r}; allowed: 'none', 'cpu' "
            "(NVMe offload is not supported)"
        )
    ratio = section.get("ratio", 1)
    if device == "cpu" and (isinstance(ratio, bool) or ratio not in (1, 1.0)):
        raise ConfigError(
            f"config key '{key}.ratio' is {ratio!r}; mpar offloads all of it or none: "
            "leave 'ratio' out (or 1)"
        )
    return str(device)


def _translate_deepspeed_zero(section: object) -> dict[str, object]:
    section = _require_mapping(section, "zero_optimization")
    for key in section:
        if key not in _DEEPSPEED_ZERO_KEYS:
            raise _unknown_key(key, " in 'zero_optimization'", _DEEPSPEED_ZERO_KEYS)
    _check_deepspeed_off(section)
    zero: dict[str, object] = {"stage": section.get("stage", 0)}
    zero["offload_optimizer"] = _offload_device(
        section.get("offload_optimizer"), "zero_optimization.offload_optimizer"
    )
    zero["offload_params"] = _offload_device(
        section.get("offload_param"), "zero_optimization.offload_param"
    )
    for legacy, key in _DEEPSPEED_LEGACY.items():
        if legacy not in section:
            continue
        flag = section[legacy]
        if not isinstance(flag, bool):
            raise ConfigTypeError(
                f"config key 'zero_optimization.{legacy}' must be true or false, got {flag!r}"
            )
        if flag and zero[key] == "none":
            zero[key] = "cpu"
    size = section.get("reduce_bucket_size", "auto")
    if size != "auto":
        if isinstance(size, bool) or not isinstance(size, int | float) or not 0 < size < 2**63:
            raise ConfigError(
                "config key 'zero_optimization.reduce_bucket_size' must be a positive number of "
                f'elements (or "auto": mpar\'s default), got {size!r}'
            )
        zero["bucket_mb"] = float(size) * 4 / 2**20  # DeepSpeed counts fp32 elements
    return zero


def _check_deepspeed_off(section: Mapping[str, object]) -> None:
    """DeepSpeed features mpar lacks are refused unless given at their off value."""
    for key, off in _DEEPSPEED_OFF.items():
        value = section.get(key, off)
        if value != off or isinstance(value, bool) is not isinstance(off, bool):
            raise ConfigError(
                f"config key 'zero_optimization.{key}' is {value!r}: mpar has no such "
                f"feature (DeepSpeed's ZeRO++ / MiCS); leave it out or set it to {off!r}"
            )


def _zero_from(raw: Mapping[str, object]) -> ZeroConfig:
    sources: list[tuple[str, dict[str, object]]] = []
    if "zero" in raw:
        zero = dict(_require_mapping(raw["zero"], "zero"))
        for key in zero:
            if key not in _ZERO_KEYS:
                raise _unknown_key(key, " in 'zero'", _ZERO_KEYS)
        sources.append(("zero", zero))
    if "zero_optimization" in raw:
        sources.append(("zero_optimization", _translate_deepspeed_zero(raw["zero_optimization"])))
    if "shard_optimizer_state" in raw:
        flag = raw["shard_optimizer_state"]
        if not isinstance(flag, bool):
            raise ConfigTypeError(
                f"config key 'shard_optimizer_state' must be true or false, got {flag!r}"
            )
        if flag:
            sources.append(("shard_optimizer_state", {"stage": 1}))
    if len(sources) > 1:
        stages = {name: s.get("stage", 0) for name, s in sources}
        if len(set(stages.values())) > 1:
            raise ConfigError(
                f"conflicting ZeRO settings {stages}; give the ZeRO stage in one place "
                "('zero', 'zero_optimization' or 'shard_optimizer_state')"
            )
    merged: dict[str, Any] = {}  # user values: ZeroConfig checks each field's type
    for _, values in sources:
        merged.update(values)
    if merged.get("stage") == "auto":  # a placeholder the offload settings allow
        params = merged.get("offload_params") == "cpu"
        merged["stage"] = 3 if params else 1 if merged.get("offload_optimizer") == "cpu" else 0
    return ZeroConfig(**merged)


_BLOCK_KEYS = tuple(f.name for f in BlockCheckpointing.__dataclass_fields__.values())


def _block_checkpointing_from(raw: Mapping[object, object]) -> BlockCheckpointing:
    """``activation_checkpointing`` given as a dict: ``{"mode": ..., "every": k}``."""
    for key in raw:
        if key not in _BLOCK_KEYS:
            raise _unknown_key(str(key), " in 'activation_checkpointing'", _BLOCK_KEYS)
    merged: dict[str, Any] = {str(k): v for k, v in raw.items()}  # checked by the dataclass
    return BlockCheckpointing(**merged)


def _readable(device: object) -> bool:
    """Whether the device may be one whose memory the planner reads (CUDA): then a
    missing ``device_memory`` is checked by ``mpar.init``, once the device is picked."""
    return device in ("auto", "cuda")


def _auto_requests(raw: Mapping[str, object], values: dict[str, object]) -> tuple[str, ...]:
    """Keys given as "auto"; their values become placeholders until the planner runs."""
    zero = raw.get("zero")
    found = [k for k in AUTO_KEYS if "." not in k and values.get(k) == "auto"]
    if isinstance(zero, Mapping) and zero.get("stage") == "auto":
        found.append("zero.stage")
    for key in found:
        if key in values:
            values[key] = False if key == "activation_checkpointing" else 1
    if found and raw.get("device_memory") is None and not _readable(raw.get("device", "auto")):
        raise ConfigError(
            f"config keys {found} are 'auto' but 'device_memory' is not set; the planner needs "
            'the memory per rank, e.g. "device_memory": "16GiB" (read from the device on CUDA)'
        )
    return tuple(found)


def _check_keys(raw: Mapping[str, object]) -> None:
    """Every key a string mpar takes; keys of smp or DeepSpeed that it does not take are
    named all at once, each with its mpar equivalent."""
    unknown = []
    for key in raw:
        if not isinstance(key, str):
            raise ConfigTypeError(f"config keys must be strings, got {key!r}")
        if key not in ACCEPTED_KEYS:
            unknown.append(key)
    if not unknown:
        return
    error = foreign_keys_error(unknown, [k for k in unknown if k not in FOREIGN_KEYS])
    raise _unknown_key(unknown[0], "", ACCEPTED_KEYS) if error is None else error


def _deepspeed_value(key: str, value: object) -> object:
    """A DeepSpeed section given for an mpar key: ``fp16`` / ``bf16``'s ``{"enabled":
    ...}`` as the flag, the sections whose key means something else in mpar refused."""
    if key in ("fp16", "bf16") and isinstance(value, Mapping):
        return precision_flag(key, value)
    error = deepspeed_section_error(key, value)
    if error is not None:
        raise error
    return value


def config_from_dict(raw: Mapping[str, object] | None) -> Config:
    """Build a :class:`Config` from user keys (canonical, aliases, smp, DeepSpeed)."""
    if raw is None:
        return Config()
    raw = _require_mapping(raw, "config")
    _check_keys(raw)
    values: dict[str, Any] = {}  # user values: Config checks each field's type
    for key, value in raw.items():
        if key in _TRANSLATED or key == "zero":
            continue
        canonical = _ALIASES.get(key, key)
        if canonical in values:
            aliases = [a for a, c in _ALIASES.items() if c == canonical]
            raise ConfigError(
                f"config keys {canonical!r} and its alias {aliases[0]!r} are both given; keep one"
            )
        values[canonical] = _deepspeed_value(canonical, value)
    auto = _auto_requests(raw, values)
    values["zero"] = _zero_from(raw)
    if isinstance(values.get("activation_checkpointing"), Mapping):
        values["activation_checkpointing"] = _block_checkpointing_from(
            values["activation_checkpointing"]
        )
    if isinstance(values.get("trace"), os.PathLike):
        values["trace"] = os.fspath(values["trace"])
    return Config(**values, auto_keys=auto)


def _read_file(path: Path) -> object:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from None


def _from_env() -> object:
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_VAR} holds invalid JSON: {exc}") from None
    return _read_file(Path(text))


def _env_source() -> str:
    text = os.environ.get(ENV_VAR, "").strip()
    where = "inline JSON" if text.startswith("{") else repr(text)
    return f"{ENV_VAR} ({where}; `mpar launch --config` sets it)"


_SECTIONS = ("zero", "zero_optimization")
"""Keys whose values are sections, merged key by key."""


def merge_configs(
    first: Mapping[str, object],
    second: Mapping[str, object],
    sources: tuple[str, str],
    *,
    section: str = "",
) -> dict[str, object]:
    """``first`` and ``second`` as one config: each key from whichever gives it, a
    key both give only when their values agree (sections key by key, an alias as
    its canonical key); ``sources`` name the two in the error, ``section`` (``"zero."``)
    prefixes the keys it names."""
    merged: dict[str, object] = dict(first)
    canonical = {_ALIASES.get(k, k): k for k in first if isinstance(k, str)}
    for key, value in second.items():
        mine = canonical.get(_ALIASES.get(key, key), key) if isinstance(key, str) else key
        if mine not in merged:
            merged[key] = value
            continue
        have = merged[mine]
        if key in _SECTIONS and isinstance(have, Mapping) and isinstance(value, Mapping):
            merged[mine] = merge_configs(have, value, sources, section=f"{section}{key}.")
            continue
        if have != value or type(have) is not type(value):
            raise ConfigError(
                f"config key '{section}{key}' is {have!r} in {sources[0]} but {value!r} in "
                f"{sources[1]}: the two configs are merged and may not disagree; give the "
                "key in one of them (or the same value in both)"
            )
    return merged


def _with_environment(given: Mapping[str, object], source: str) -> Mapping[str, object]:
    """``given`` merged with the config in ``MPAR_CONFIG``, if any (:func:`merge_configs`)."""
    env = _from_env()
    if env is None:
        return given
    return merge_configs(given, _require_mapping(env, ENV_VAR), (source, _env_source()))


def _with_env_overrides(config: Config) -> Config:
    """``config`` with the overrides of ``MPAR_TRACE`` and ``MPAR_SPLIT_BACKWARD``."""
    trace = config.trace if config.trace is not None else os.environ.get(TRACE_ENV_VAR) or None
    split = os.environ.get(SPLIT_BACKWARD_ENV_VAR, "").strip().lower()
    if split and split not in _TRUE + _FALSE:
        raise ConfigError(
            f"{SPLIT_BACKWARD_ENV_VAR}={split!r} is not a switch; set it to 0 or 1 "
            "(or unset it and use the config key 'split_backward')"
        )
    split_backward = split in _TRUE if split else config.split_backward
    if (trace, split_backward) == (config.trace, config.split_backward):
        return config
    return dataclasses.replace(config, trace=trace, split_backward=split_backward)


def load_config(
    config: Config | Mapping[str, object] | str | os.PathLike[str] | None,
    *,
    defaults: Mapping[str, object] | None = None,
) -> Config:
    """Resolve what ``mpar.init`` was given into a :class:`Config`.

    ``config`` is a :class:`Config`, a dict, a path to a JSON or YAML file, or
    None — then the ``MPAR_CONFIG`` variable (a path, or inline JSON), then
    ``defaults`` (a dict; None: the defaults of :class:`Config`). A dict or a file
    given while ``MPAR_CONFIG`` is set is merged with it (:func:`merge_configs`:
    a key both give must agree). The environment overrides (``MPAR_TRACE``,
    ``MPAR_SPLIT_BACKWARD``) apply to each; this is the only place they are read.
    """
    if isinstance(config, Config):
        return _with_env_overrides(config)
    if config is None:
        raw = _from_env()
        given = defaults if raw is None else _require_mapping(raw, "config")
        return _with_env_overrides(config_from_dict(given))
    if isinstance(config, str | os.PathLike):
        read = _read_file(Path(config))  # an empty file: the defaults
        given = {} if read is None else _require_mapping(read, "config")
        merged = _with_environment(given, f"the config file {os.fspath(config)!r}")
        return _with_env_overrides(config_from_dict(merged))
    if isinstance(config, Mapping):
        merged = _with_environment(config, "the dict given to mpar.init")
        return _with_env_overrides(config_from_dict(merged))
    raise ConfigTypeError(
        "mpar.init(config) takes a dict, a path to a JSON/YAML file, or None; "
        f"got {type(config).__name__}"
    )
