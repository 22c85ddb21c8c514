"""Dynamic loss scaling for fp16 mixed precision (pure: floats and counters).

The loss is multiplied by ``scale`` before backward so that small fp16
gradients do not flush to zero; the optimizer divides it out again. A step
whose gradients hold an inf or NaN anywhere is skipped and the scale halves;
after ``growth_interval`` finite steps in a row it doubles. The constants are
those of ``torch.amp.GradScaler``'s defaults. A run of :data:`WARN_AFTER`
skipped steps in a row (and every doubling of that run) warns: the gradients
then overflow at any scale, and training has silently stopped.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["WARN_AFTER", "LossScaler"]

WARN_AFTER = 10


@dataclass
class LossScaler:
    """The current loss scale and the counter that grows it."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    finite_steps: int = 0
    """Finite steps since the scale last changed."""
    skipped_steps: int = 0
    """Steps skipped so far because of inf or NaN gradients."""
    skipped_in_a_row: int = 0
    kept_past_step: bool = False
    """An optimizer step read the gradients and no ``zero_grad`` has cleared them yet:
    they are unscaled (or, skipped, not finite), so a training step must not add
    loss-scaled gradients to them (``DistributedModel.run_step`` refuses it)."""

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the step was skipped)."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.finite_steps = 0
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            n = self.skipped_in_a_row
            if n == WARN_AFTER or (n > WARN_AFTER and n & (n - 1) == 0):  # 10, 16, 32, ...
                warnings.warn(self._stuck_message(), RuntimeWarning, stacklevel=3)
            return
        self.skipped_in_a_row = 0
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.finite_steps = 0

    def _stuck_message(self) -> str:
        return (
            f"fp16: the last {self.skipped_in_a_row} optimizer steps were all skipped "
            f"(inf or NaN gradients) and the loss scale fell to {self.scale:g}: the parameters "
            "do not change. The model overflows in fp16 at any scale, or its loss is NaN: "
            "check the loss, lower the learning rate, or use bf16"
        )

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "finite_steps": self.finite_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.scale = float(state["scale"])
        self.finite_steps = int(state["finite_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
