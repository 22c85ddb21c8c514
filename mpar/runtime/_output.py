"""StepOutput: what a ``@mpar.step`` function returned, for every microbatch.

The outputs of every microbatch of every data-parallel replica are gathered,
in global batch order (replica 0's microbatches, then replica 1's, ...), so a
StepOutput is the same on every rank and ``concat()`` equals what one process
would compute on the whole global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from mpar import _device
from mpar._tree import tree_map
from mpar.errors import StepError

__all__ = ["StepOutput"]


T = TypeVar("T")
_SCALARS = (int, float, bool, str, bytes, type(None))


def check_gatherable(value: object, where: str = "the step function's return value") -> None:
    """Raise StepError unless ``value`` is tensors/numbers/strings in lists, tuples, dicts."""
    if isinstance(value, (torch.Tensor, *_SCALARS)):
        return
    if isinstance(value, tuple | list):
        for i, item in enumerate(value):
            check_gatherable(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_gatherable(item, f"{where}[{key!r}]")
        return
    raise StepError(
        f"{where} is a {type(value).__name__}, which mpar cannot gather to every rank; "
        "return tensors, numbers, strings or None (or lists, tuples and dicts of them)"
    )


def detach_to_cpu(value: T) -> T:
    """A copy of ``value`` with every tensor detached and on the CPU: copies issued
    together (non-blocking from a CUDA device) and waited for once, a single host
    synchronization however many tensors (a step's microbatch outputs) it holds."""
    devices: set[torch.device] = set()

    def copy(t: torch.Tensor) -> torch.Tensor:
        devices.add(t.device)  # a CPU one too: counted as the device's wait would be
        return _device.copy_to_host(t)

    out = tree_map(copy, value)
    for device in devices:
        _device.wait_copies(device, "step outputs to the host")
    return out


def detach(value: T) -> T:
    """``value`` with every tensor detached, where it is (no copy, no host wait)."""
    return tree_map(lambda t: t.detach(), value)


def _zip_apply(values: Sequence[Any], fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return fn([torch.as_tensor(v) for v in values])
    if isinstance(first, int | float) and not isinstance(first, bool):
        return fn([torch.as_tensor(v, dtype=torch.float64) for v in values]).item()
    if isinstance(first, tuple | list):
        items = [_zip_apply([v[i] for v in values], fn) for i in range(len(first))]
        return type(first)(items)
    if isinstance(first, dict):
        return type(first)((k, _zip_apply([v[k] for v in values], fn)) for k in first)
    raise TypeError(
        f"StepOutput cannot reduce values of type {type(first).__name__}; return tensors or "
        "numbers (or tuples/dicts of them) from the step function"
    )


class StepOutput:
    """Per-microbatch results of a step, identical on every rank.

    ``outputs[i]`` is the value the step function returned for global
    microbatch ``i``; ``sizes[i]`` is its number of samples; ``targets[i]``, where the
    step's arguments held integer ``labels``, its number of kept targets (labels other
    than -100; those of the model's own loss where it was called with ``labels``), else
    None.

    ``on_device``: the outputs are still where the step computed them (a job of one
    rank, where nothing has to be gathered): they are copied to the host, in one
    counted wait, when first read (:attr:`outputs` and every method but ``len``), so
    a step whose outputs nobody reads never waits for the device.
    """

    def __init__(
        self,
        outputs: list[Any],
        sizes: list[int],
        *,
        on_device: bool = False,
        targets: torch.Tensor | list[int] | None = None,
    ) -> None:
        self._values = outputs
        self._on_device = on_device
        self.sizes = sizes
        self._targets = targets

    @property
    def outputs(self) -> list[Any]:
        """Every microbatch's output, on the host."""
        if self._on_device:
            self._values, self._targets = detach_to_cpu((self._values, self._targets))
            self._on_device = False
        return self._values

    @property
    def targets(self) -> list[int] | None:
        """Each microbatch's number of kept targets (labels other than -100) where the
        step's arguments held integer ``labels``; None otherwise."""
        self.outputs  # noqa: B018 - on the host first, in the outputs' one wait
        if isinstance(self._targets, torch.Tensor):
            self._targets = [int(n) for n in self._targets.tolist()]
        return self._targets

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Any:
        return iter(self.outputs)

    def __getitem__(self, index: int | str) -> Any:
        """``out[i]``: microbatch ``i``'s output; ``out["loss"]``: a StepOutput of that
        field of dict outputs (``out["loss"].reduce_mean()``)."""
        if isinstance(index, str):
            picked = [o[index] for o in self._values]
            return StepOutput(picked, self.sizes, on_device=self._on_device, targets=self._targets)
        return self.outputs[index]

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches)"

    def reduce_mean(self) -> Any:
        """Mean over microbatches, weighted by microbatch size: the whole-batch mean
        of a mean-reduced loss (equal to the plain mean when microbatches are even).
        Where the targets were counted (:attr:`targets`), weighted by kept targets
        instead: the mean over every kept target of the batch (a microbatch without
        any, whose own mean is NaN, weighs nothing).
        Integer and bool tensors give a float64 mean, weighted alike (as numbers do)."""
        counts = self.targets
        shares = self.sizes if counts is None or not sum(counts) else counts
        total = float(sum(shares))
        weights = [share / total for share in shares]

        def mean(ts: list[torch.Tensor]) -> torch.Tensor:
            weighted = sum(
                (w * t.to(torch.float64) for w, t in zip(weights, ts) if w),
                torch.zeros((), dtype=torch.float64),
            )
            return weighted.to(ts[0].dtype) if ts[0].is_floating_point() else weighted

        return _zip_apply(self.outputs, mean)

    def reduce_sum(self) -> Any:
        """Sum over microbatches."""
        return _zip_apply(self.outputs, lambda ts: torch.stack(ts).sum(0))

    def concat(self, dim: int = 0) -> Any:
        """Microbatch outputs concatenated along ``dim`` (the whole batch's outputs);
        scalars are stacked."""
        return _zip_apply(
            self.outputs,
            lambda ts: torch.stack(ts) if ts[0].dim() == 0 else torch.cat(ts, dim),
        )

    def stack(self, dim: int = 0) -> Any:
        """Microbatch outputs stacked along a new ``dim``."""
        return _zip_apply(self.outputs, lambda ts: torch.stack(ts, dim))
