"""Expert parallelism: the experts of each mixture-of-experts layer split over ranks.

See ``docs/expert_parallel.md``. The token dispatch is made of operators in
``mpar.comm._ep_ops``; experts modules are found in ``_moe_blocks``, split in
``_ep_layout``; router balance losses are made exact over data parallelism in
``_router_aux``; ``_ep_measure`` measures what the planner needs.
"""

from mpar.expert_parallel._ep_layout import Elsewhere, EPLayout, apply_ep_layout, plan_ep_layout
from mpar.expert_parallel._ep_measure import measure_ep_splits
from mpar.expert_parallel._moe_blocks import (
    EPPlanError,
    ExpertsModule,
    describe_experts,
    find_experts,
)
from mpar.expert_parallel._router_aux import install_router_aux, router_aux_loss

__all__ = [
    "EPLayout",
    "EPPlanError",
    "Elsewhere",
    "ExpertsModule",
    "apply_ep_layout",
    "describe_experts",
    "find_experts",
    "install_router_aux",
    "measure_ep_splits",
    "plan_ep_layout",
    "router_aux_loss",
]
