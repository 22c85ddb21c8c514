"""What expert parallelism splits in each partition unit, measured for the planner.

:func:`measure_ep_splits` gives ``mpar.partition.EPSplits``: per unit, its experts'
parameter bytes (exact, from the experts modules' own parameters) and the
(token, expert) pairs its MoE layers route per microbatch, with their hidden size:
one forward of the whole model on fake tensors (nothing is computed or allocated),
in which every experts module only records its call (``T`` rows of ``H`` features,
``k`` experts each) and returns zeros: the experts themselves never run.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpar._compat import FakeTensorMode, pytree
from mpar.expert_parallel._moe_blocks import ExpertsModule, find_experts
from mpar.partition._ep_share import EPSplits, UnitExperts

if TYPE_CHECKING:
    from mpar.profile import ModelProfile

__all__ = ["measure_ep_splits"]

Calls = dict[str, list[tuple[int, int, int, int]]]
"""Experts module name -> (rows, k, hidden, bytes per element) of each call."""


def _owner(name: str, units: Sequence[str]) -> str | None:
    """The unit holding module ``name`` (the longest unit name that contains it)."""
    found = [u for u in units if not u or name == u or name.startswith(u + ".")]
    return max(found, key=len, default=None)


@contextlib.contextmanager
def _recording(
    module: nn.Module, found: Mapping[str, ExpertsModule], calls: Calls
) -> Iterator[None]:
    """Every experts module records its calls and returns zeros while inside."""
    saved = {}
    for name in found:
        mod = module.get_submodule(name)
        saved[name] = mod.__dict__.get("forward")

        def record(
            self: nn.Module, x: torch.Tensor, index: torch.Tensor, w: torch.Tensor, _n: str = name
        ) -> torch.Tensor:
            calls.setdefault(_n, []).append(
                (int(x.shape[0]), int(index.shape[-1]), int(x.shape[-1]), x.element_size())
            )
            return torch.zeros_like(x)

        mod.forward = types.MethodType(record, mod)
    try:
        yield
    finally:
        for name, forward in saved.items():
            mod = module.get_submodule(name)
            if forward is None:
                del mod.forward
            else:
                mod.forward = forward


def _holders(module: nn.Module, name: str, units: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The units holding experts module ``name``'s parameters, each with the module
    whose parameters are its part: the unit containing it, or else the units inside it
    (a ``ModuleList`` of per-expert modules is split into units, one per expert)."""
    owner = _owner(name, units)
    if owner is not None:
        return [(owner, module.get_submodule(name))]
    return [(u, module.get_submodule(u)) for u in units if u.startswith(name + ".")]


def _add(
    old: UnitExperts, params: list[nn.Parameter], rows: list[tuple[int, int, int, int]], e: int
) -> UnitExperts:
    """``old`` with ``params`` and the routed ``rows`` of one experts module added."""
    return UnitExperts(
        param_count=old.param_count + sum(p.numel() for p in params),
        param_bytes=old.param_bytes + sum(p.numel() * p.element_size() for p in params),
        grad_bytes=old.grad_bytes
        + sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        row_bytes=old.row_bytes + sum(t * k * h * b for t, k, h, b in rows),
        pairs=old.pairs + sum(t * k for t, k, _, _ in rows),
        layers=old.layers + len(rows),
        num_experts=e,
    )


def _calls(
    module: nn.Module, found: Mapping[str, ExpertsModule], inputs: tuple[object, object]
) -> Calls:
    from mpar.profile import preserved_state

    calls: Calls = {}
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    faked = pytree.tree_map(
        lambda x: (
            fake.from_tensor(x.to("meta") if meta else x) if isinstance(x, torch.Tensor) else x
        ),
        inputs,
    )
    args, kwargs = faked
    with preserved_state(module), fake, torch.no_grad(), _recording(module, found, calls):
        module(*args, **kwargs)
    return calls


def measure_ep_splits(
    module: nn.Module,
    profile: ModelProfile,
    inputs: tuple[Sequence[object], Mapping[str, object]],
    *,
    plan: Mapping[str, str] | None = None,
) -> EPSplits:
    """``EPSplits`` of ``module`` (its experts modules: by structure, or ``plan`` as the
    config's ``ep_plan``) for its ``profile`` and one microbatch ``inputs``."""
    found = find_experts(module, plan)
    if not found:
        return EPSplits(source="no experts module found")
    args, kwargs = inputs
    calls = _calls(module, found, (tuple(args), dict(kwargs)))
    units: dict[str, UnitExperts] = {}
    for name, em in found.items():
        rows = calls.get(name, [])
        for i, (unit, part) in enumerate(_holders(module, name, profile.names)):
            params = list(part.parameters())
            routed = rows if i == 0 else []  # the all-to-alls: once per experts module
            units[unit] = _add(units.get(unit, UnitExperts()), params, routed, em.num_experts)
    source = "the config's ep_plan" if plan is not None else "the MoE blocks found by structure"
    return EPSplits(units, tuple(em.num_experts for em in found.values()), source)
