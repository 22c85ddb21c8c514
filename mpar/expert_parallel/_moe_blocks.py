"""Finding the experts modules of mixture-of-experts layers, by structure or by plan.

Expert parallelism splits *experts modules*: a module called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` that
returns, for each token, the routing-weighted sum of its ``k`` experts' outputs. It
holds ``E`` experts in one of two forms:

* **fused**: its own parameters stack the experts on their first dimension
  (transformers 5's ``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``:
  ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``); its forward indexes them by
  expert and may read ``self.num_experts``;
* **per expert**: an ``nn.ModuleList`` of ``E`` modules of the same shapes (the module
  itself, or its one list child), each mapping ``[n, H]`` rows to ``[n, H]``.

Without ``ep_plan``, an experts module is recognised beside its router: a sibling
module with a 2-D ``weight`` of ``E`` rows (``nn.Linear(H, E)``, a Hugging Face
``TopKRouter``), as in every MoE block of transformers 5. An ``ep_plan`` names the
experts modules instead (module-name patterns as in ``tp_plan``: ``*`` is one name
component, and a pattern matches a name's last components), each ``"experts"`` or
``"replicate"`` (left whole).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from mpar.errors import ConfigError
from mpar.tensor_parallel import name_matches

__all__ = ["EPPlanError", "ExpertsModule", "describe_experts", "find_experts"]


class EPPlanError(ConfigError):
    """An expert-parallel plan (or model) that expert parallelism cannot apply to."""


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module: where it is, how many experts, and in which form."""

    name: str
    """Its module name in the model."""
    num_experts: int
    fused: tuple[str, ...] = ()
    """Fused form: the names of its parameters (experts on dimension 0)."""
    listed: str | None = None
    """Per-expert form: the name of the ``nn.ModuleList`` of experts relative to the
    module (``""``: the module is that list); None for the fused form."""

    def list_of(self, module: nn.Module) -> nn.ModuleList:
        """The per-expert list inside ``module`` (this experts module)."""
        found = module if not self.listed else module.get_submodule(self.listed)
        assert isinstance(found, nn.ModuleList)
        return found


def _takes_routing(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes (hidden, top_k_index, top_k_weights)."""
    forward = type(module).forward
    if forward is nn.ModuleList.forward or forward is nn.Module.forward:
        return False
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _same_shapes(modules: list[nn.Module]) -> bool:
    first = [tuple(p.shape) for p in modules[0].parameters()]
    return bool(first) and all([tuple(p.shape) for p in m.parameters()] == first for m in modules)


def _per_expert(name: str, module: nn.Module) -> ExpertsModule | None:
    lists = [(n, c) for n, c in module.named_children() if isinstance(c, nn.ModuleList)]
    if isinstance(module, nn.ModuleList):
        listed, experts = "", list(module)
    elif len(lists) == 1 and not list(module.parameters(recurse=False)):
        listed, experts = lists[0][0], list(lists[0][1])
        others = [c for n, c in module.named_children() if n != listed]
        if any(True for c in others for _ in c.parameters()):
            return None
    else:
        return None
    if len(experts) < 2 or not _same_shapes(experts):
        return None
    return ExpertsModule(name, len(experts), listed=listed)


def _fused(name: str, module: nn.Module) -> ExpertsModule | None:
    own = list(module.named_parameters(recurse=False))
    if not own or any(True for c in module.children() for _ in c.parameters()):
        return None
    leading = {p.shape[0] if p.dim() >= 2 else -1 for _, p in own}
    if len(leading) != 1 or min(leading) < 2:
        return None
    return ExpertsModule(name, leading.pop(), fused=tuple(n for n, _ in own))


def describe_experts(name: str, module: nn.Module) -> ExpertsModule | None:
    """``module`` as an experts module, or None when it is not one (see the module)."""
    if not _takes_routing(module):
        return None
    return _fused(name, module) or _per_expert(name, module)


def _router_sizes(parent: nn.Module) -> set[int]:
    """The row counts of the 2-D ``weight`` of ``parent``'s children: possible routers."""
    sizes = set()
    for child in parent.children():
        weight = child._parameters.get("weight")
        if weight is not None and weight.dim() == 2 and weight.shape[0] >= 2:
            sizes.add(int(weight.shape[0]))
    return sizes


def _by_structure(module: nn.Module) -> dict[str, ExpertsModule]:
    found: dict[str, ExpertsModule] = {}
    for parent_name, parent in module.named_modules():
        routers = _router_sizes(parent)
        if not routers:
            continue
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            described = describe_experts(name, child)
            if described is not None and described.num_experts in routers:
                found[name] = described
    return found


def _not_experts(pattern: str, name: str, module: nn.Module) -> EPPlanError:
    return EPPlanError(
        f"ep_plan entry {pattern!r} matches module {name!r} ({type(module).__name__}), which "
        "is not an experts module mpar can split: it must be called as experts(hidden [T, H], "
        "top_k_index [T, k], top_k_weights [T, k]) and hold its E experts either as its own "
        "parameters with the expert index first ([E, ...]) or as an nn.ModuleList of E "
        "modules of the same shapes (see docs/expert_parallel.md)"
    )


def _by_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, ExpertsModule]:
    found: dict[str, ExpertsModule] = {}
    matched = set()
    for name, mod in module.named_modules():
        pattern = next((p for p in plan if name and name_matches(p, name)), None)
        if pattern is None:
            continue
        matched.add(pattern)
        if plan[pattern] == "experts":
            described = describe_experts(name, mod)
            if described is None:
                raise _not_experts(pattern, name, mod)
            found[name] = described
    unused = [p for p, style in plan.items() if style == "experts" and p not in matched]
    if unused:
        raise EPPlanError(
            f"ep_plan entries {unused} match no module of {type(module).__name__}; module "
            f"names look like {[n for n, _ in module.named_modules()][1:6]}"
        )
    return found


def find_experts(module: nn.Module, plan: Mapping[str, str] | None) -> dict[str, ExpertsModule]:
    """The experts modules of ``module``: those ``plan`` marks ``"experts"``, or without
    a plan those found beside a router (see the module docstring)."""
    if plan is not None:
        return _by_plan(module, plan)
    return _by_structure(module)
