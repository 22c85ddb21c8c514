"""Per-unit compute (FLOPs, measured time) and memory (parameters, activations) profiles."""

from __future__ import annotations

from mpar.profile._profile import (
    OPTIMIZER_BYTES_PER_PARAM,
    ModelProfile,
    UnitProfile,
    preserved_state,
    profile_mode,
    profile_model,
)

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "ModelProfile",
    "UnitProfile",
    "preserved_state",
    "profile_mode",
    "profile_model",
]
