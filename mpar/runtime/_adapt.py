"""Make an ordinary model safe to run microbatch by microbatch across stages.

Hugging Face models keep a key/value cache (``use_cache``, on by default in
their configs) that every attention layer appends to and the model returns as
``past_key_values``. In training it only costs memory, and across a pipeline
it is state that would cross stage boundaries and leak from one microbatch
into the next. Hugging Face itself turns it off when gradient checkpointing is
on; mpar turns it off when it wraps a model, for every submodule whose
``config`` has ``use_cache`` set. Losses, outputs and gradients do not change.
Set ``model.module.config.use_cache = True`` again to generate with the
unwrapped model.
"""

from __future__ import annotations

from torch import nn

__all__ = ["disable_caches"]


def disable_caches(module: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` wherever it is true; return the modules changed."""
    changed = []
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            config.use_cache = False
            changed.append(name or "<root>")
    return changed
