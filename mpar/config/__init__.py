"""mpar configuration: typed dataclasses inside, dicts/JSON/YAML at the boundary."""

from mpar.config._boundary import (
    ACCEPTED_KEYS,
    ENV_VAR,
    TRACE_ENV_VAR,
    config_from_dict,
    load_config,
)
from mpar.config._schema import (
    MEMORY_WEIGHT_FOR,
    BlockCheckpointing,
    Config,
    PrecisionKind,
    ZeroConfig,
)

__all__ = [
    "ACCEPTED_KEYS",
    "ENV_VAR",
    "MEMORY_WEIGHT_FOR",
    "TRACE_ENV_VAR",
    "BlockCheckpointing",
    "Config",
    "PrecisionKind",
    "ZeroConfig",
    "config_from_dict",
    "load_config",
]
