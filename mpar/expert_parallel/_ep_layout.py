"""Turning a model's experts modules into this rank's share of them.

:func:`plan_ep_layout` checks, when the model is wrapped, that every experts module
(:mod:`mpar.expert_parallel._moe_blocks`) splits over the ep degree; :func:`apply_ep_layout`
then, on every rank, keeps the ``E / ep`` experts of its ep rank (experts
``[r E / ep, (r + 1) E / ep)``) and gives each experts module a forward that sends
its tokens to their experts' ranks and back (the operators of :mod:`mpar.comm._ep_ops`):

=============  ==================================  ====================================
form           what the rank keeps                 forward
=============  ==================================  ====================================
fused          rows ``[r E/ep, (r+1) E/ep)`` of     dispatch; the module's own forward
               every parameter (same names, so      on the received rows with their
               checkpoints key experts by their     local expert index (and
               global index)                        ``num_experts`` = E/ep); combine
per expert     its experts' modules, at their       dispatch; each local expert on its
               global index in the list (the        rows, weighted, summed; combine
               others are empty placeholders)
=============  ==================================  ====================================

The router and everything else of the MoE block stay as they are: the router routes
this rank's tokens only.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpar.comm._ep_ops import ep_combine, ep_dispatch
from mpar.expert_parallel._moe_blocks import EPPlanError, ExpertsModule, find_experts
from mpar.tensor_parallel import TPShard

__all__ = ["EPLayout", "Elsewhere", "apply_ep_layout", "plan_ep_layout"]


@dataclass
class EPLayout:
    """The checked expert-parallel plan of one model."""

    size: int
    """The ep degree."""
    experts: dict[str, ExpertsModule]
    """Module name -> the experts module there."""
    shards: dict[str, TPShard] = field(default_factory=dict)
    """Fused parameter name -> its split (dimension 0 in ``size`` pieces)."""
    placed: dict[str, int] = field(default_factory=dict)
    """Per-expert parameter or buffer name -> the global index of its expert."""
    source: str = ""

    def holder(self, name: str, num_experts: int) -> int:
        """The ep rank that holds per-expert tensor ``name`` (of ``num_experts``)."""
        return self.placed[name] // (num_experts // self.size)

    def experts_of(self, name: str) -> ExpertsModule | None:
        """The experts module that holds tensor ``name``, if any."""
        owner = name.rpartition(".")[0]
        while owner:
            if owner in self.experts:
                return self.experts[owner]
            owner = owner.rpartition(".")[0]
        return None

    def holds(self, name: str, rank: int) -> bool:
        """Whether ep rank ``rank`` holds (some of) tensor ``name``."""
        if name not in self.placed:
            return True
        found = self.experts_of(name)
        assert found is not None
        return self.holder(name, found.num_experts) == rank


class Elsewhere(nn.Module):
    """The place of an expert that another rank of the ep group holds."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(
            f"expert {self.index} is held by another rank of the expert-parallel group; "
            "it is run by the experts module's expert-parallel forward"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_ep_layout(module: nn.Module, ep: int, plan: Mapping[str, str] | None) -> EPLayout | None:
    """The experts of ``module`` split over ``ep`` ranks, checked; None when ``ep`` is 1.
    Raises :class:`EPPlanError` naming the module and the numbers when it cannot."""
    if ep == 1:
        return None
    source = "the config's ep_plan" if plan is not None else "the MoE blocks found by structure"
    found = find_experts(module, plan)
    if not found:
        raise EPPlanError(
            f"expert_parallel_degree is {ep} but {type(module).__name__} has no experts module "
            "mpar recognises (a module called as experts(hidden, top_k_index, top_k_weights) "
            "beside a router with one row per expert): name yours in the config key 'ep_plan' "
            "(e.g. {'blocks.*.moe.experts': 'experts'}, see docs/expert_parallel.md) or set "
            "expert_parallel_degree to 1"
        )
    layout = EPLayout(ep, found, source=source)
    for name, em in found.items():
        if em.num_experts % ep:
            raise EPPlanError(
                f"{name} ({type(module.get_submodule(name)).__name__}) has {em.num_experts} "
                f"experts, which do not split over expert_parallel_degree {ep}; use a degree "
                f"in {_divisors(em.num_experts)} that divides the data-parallel degree"
            )
        mod = module.get_submodule(name)
        for p in em.fused:
            layout.shards[f"{name}.{p}"] = TPShard(0, ep)
        if em.listed is not None:
            for e, expert in enumerate(em.list_of(mod)):
                where = f"{name}.{em.listed}.{e}" if em.listed else f"{name}.{e}"
                for n, _ in [*expert.named_parameters(), *expert.named_buffers()]:
                    layout.placed[f"{where}.{n}"] = e
    return layout


def _keep_rows(param: nn.Parameter, shard: TPShard, rank: int) -> None:
    if param.is_meta:
        shape = shard.local_shape(param.shape)
        param.data = torch.empty(shape, dtype=param.dtype, device="meta")
    else:
        param.data = shard.local(param.data, rank).clone()


Forward = Callable[..., torch.Tensor]


def _fused_forward(inner: Forward, num_experts: int, group: str) -> Forward:
    def forward(
        self: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        x, ids, w, order, counts = ep_dispatch(hidden, index, weights, num_experts, group)
        y = inner(x, ids.unsqueeze(-1), w.unsqueeze(-1))
        return ep_combine(y, x, order, counts, index.shape[-1], group)

    return forward


def _listed_forward(em: ExpertsModule, first: int, count: int, group: str) -> Forward:
    def forward(
        self: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        x, ids, w, order, counts = ep_dispatch(hidden, index, weights, em.num_experts, group)
        experts = em.list_of(self)
        y = torch.zeros_like(x)
        for i in range(count):
            rows = torch.nonzero(ids == i).squeeze(-1)
            out = experts[first + i](x[rows]) * w[rows].unsqueeze(-1)
            y.index_add_(0, rows, out.to(y.dtype))  # in place: no copy of y per expert
        return ep_combine(y, x, order, counts, index.shape[-1], group)

    return forward


def apply_ep_layout(module: nn.Module, layout: EPLayout, rank: int, group: str) -> None:
    """Make ``module`` ep rank ``rank``'s share of itself, in place (see the module)."""
    for name, em in layout.experts.items():
        mod = module.get_submodule(name)
        count = em.num_experts // layout.size
        first = rank * count
        if em.fused:
            for p in em.fused:
                _keep_rows(mod._parameters[p], layout.shards[f"{name}.{p}"], rank)  # type: ignore[arg-type]
            if isinstance(mod.__dict__.get("num_experts"), int):
                setattr(mod, "num_experts", count)  # noqa: B010 - an int, not a submodule
            forward = _fused_forward(mod.forward, em.num_experts, group)
        else:
            experts = em.list_of(mod)
            for e in range(em.num_experts):
                if not first <= e < first + count:
                    experts[e] = Elsewhere(e)
            forward = _listed_forward(em, first, count, group)
        mod.forward = types.MethodType(forward, mod)
