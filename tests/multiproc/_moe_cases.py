"""Hugging Face mixture-of-experts families for the expert-parallel tests.

Each family is built from a small config with the library's defaults (dropout is
zero, the loss computed inside the model from ``labels``), with
``output_router_logits`` on and a large ``router_aux_loss_coef``, so that the router
balance loss weighs in the loss and its gradients.

**The one-process oracle** (see ``mpar.expert_parallel._router_aux``): a step of
``M`` microbatches on ``dp`` data-parallel ranks is one process running the whole
batch as ``M`` gradient-accumulation chunks, chunk ``j`` made of every data-parallel
rank's ``j``-th microbatch. Cross-entropy does not care (a mean of equal-sized
means); the balance loss is a product of two batch means, so it does: with
``M = 1`` the chunk is the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
USER = ("tiny_listed", "tiny_fused")
"""``mpar.testing.models.TinyMoE`` with per-expert or fused experts (placed by ep_plan)."""
BATCH = 8
SEQ = 8
VOCAB = 64
EXPERTS = 4
MAX_NORM = 0.5
"""Small enough that every step clips: the global norm is part of the check."""


def build(family: str, *, experts: int = EXPERTS, layers: int = 2) -> nn.Module:
    """The family's model, seeded so every process builds the same weights."""
    torch.manual_seed(0)
    if family in USER:
        from mpar.testing.models import MoEConfig, TinyMoE

        cfg = MoEConfig(vocab_size=VOCAB, num_experts=experts, num_layers=layers)
        return TinyMoE(MoEConfig(**{**vars(cfg), "per_expert": family == "tiny_listed"}))
    import transformers as hf

    common = dict(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    )
    if family == "mixtral":
        cfg: Any = hf.MixtralConfig(**common, intermediate_size=48, num_local_experts=experts)
        return hf.MixtralForCausalLM(cfg)
    if family == "qwen2_moe":
        cfg = hf.Qwen2MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=experts,
        )
        return hf.Qwen2MoeForCausalLM(cfg)
    if family == "qwen3_moe":
        cfg = hf.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=24, num_experts=experts
        )
        return hf.Qwen3MoeForCausalLM(cfg)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: token ids (the labels too)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def chunks(ids: torch.Tensor, dp: int, microbatches: int) -> list[torch.Tensor]:
    """The oracle's accumulation chunks: chunk ``j`` is every data-parallel rank's
    ``j``-th microbatch (each rank's shard is its contiguous slice of the batch)."""
    shards = ids.chunk(dp)
    return [torch.cat([s.chunk(microbatches)[j] for s in shards]) for j in range(microbatches)]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def losses_of(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to train on, [loss, balance loss]) of one chunk: the model's own loss for a
    Hugging Face family, next-token cross-entropy (no balance loss) for ``TinyMoE``."""
    if hasattr(getattr(model, "module", model), "config"):  # a Hugging Face model
        out = model(input_ids=ids, labels=ids)
        return out.loss, torch.stack([out.loss, out.aux_loss])
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return loss, torch.stack([loss, torch.zeros_like(loss)])


def reference(
    family: str, steps: int, dp: int, microbatches: int, net: nn.Module | None = None
) -> dict[str, Any]:
    """One process, the whole batch in the oracle's chunks, plain torch (on ``net``, or
    the family's model as :func:`build` makes it)."""
    net = build(family) if net is None else net
    opt = _optimizer(net.parameters())
    losses, norms = [], []
    for s in range(steps):
        parts = []
        for chunk in chunks(batch(s), dp, microbatches):
            loss, both = losses_of(net, chunk)
            (loss / microbatches).backward()
            parts.append(both.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(parts).mean(0))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {"losses": torch.stack(losses), "norms": torch.tensor(norms), "state": state}


def wrap(family: str, *, eager: bool = False) -> tuple[Any, Any]:
    """``(DistributedModel, DistributedOptimizer)`` of the family (``mpar.init`` called);
    ``eager``: partitioned now, from a microbatch of the first batch."""
    import mpar

    example = {"input_ids": batch(0)[:2], "labels": batch(0)[:2]} if eager else None
    model = mpar.DistributedModel(build(family), example_kwargs=example)
    return model, mpar.DistributedOptimizer(_optimizer(model.parameters()))


def run_steps(model: Any, opt: Any, steps: range) -> tuple[list[torch.Tensor], list[float]]:
    """Train ``model`` on this replica's shard of the batches of ``steps``."""
    import mpar

    @mpar.step
    def train_step(m: Any, ids: torch.Tensor) -> torch.Tensor:
        loss, both = losses_of(m, ids)
        m.backward(loss)
        return both

    dp, rank = mpar.dp_size(), mpar.dp_rank()
    losses, norms = [], []
    for s in steps:
        shard = batch(s).chunk(dp)[rank]
        losses.append(train_step(model, shard).reduce_mean())
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return losses, norms


def train(family: str, steps: int, microbatches: int) -> dict[str, Any]:
    """Train one family with mpar (``mpar.init`` already called) on this replica's shard."""
    model, opt = wrap(family)
    given = list(model.parameters())  # before partitioning: every expert, as users keep them
    losses, norms = run_steps(model, opt, range(steps))
    experts = model.stages.expert_params if model.stages is not None else frozenset()
    expert_bytes = sum(
        p.numel() * p.element_size() for p in model.local_parameters() if id(p) in experts
    )
    held = {p.untyped_storage().data_ptr() for p in model.local_parameters()}
    return {
        "losses": torch.stack(losses),
        "norms": torch.tensor(norms),
        "state": model.state_dict(),
        "expert_bytes": expert_bytes,
        # storage still held by parameters this rank does not keep (other ranks' experts)
        "unheld_bytes": sum(
            p.untyped_storage().nbytes()
            for p in given
            if p.untyped_storage().data_ptr() not in held
        ),
    }


def train_ranks(families: list[str], config: dict[str, Any], steps: int) -> dict[str, Any]:
    """Rank body: every family under ``config``, in one set of processes."""
    import mpar

    mpar.init(config)
    m = config.get("microbatches", 1)
    return {family: train(family, steps, m) for family in families}


def check(
    results: list[dict[str, Any]],
    families: list[str],
    dp: int,
    m: int,
    steps: int,
    net: nn.Module | None = None,
) -> None:
    """Every rank's losses (with the balance loss), global norms and updated
    parameters equal the oracle's (fp32; on ``net`` if given)."""
    for family in families:
        ref = reference(family, steps, dp, m, net)
        for rank, r in enumerate(results):
            got, where = r[family], f"{family} on rank {rank}"
            assert got.get("unheld_bytes", 0) == 0, f"{where}: other ranks' experts still held"
            torch.testing.assert_close(
                got["losses"], ref["losses"], rtol=1e-5, atol=1e-6, msg=where
            )
            torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-6, msg=where)
            for name, tensor in ref["state"].items():
                torch.testing.assert_close(
                    got["state"][name], tensor, rtol=1e-5, atol=1e-5, msg=f"{where}: {name}"
                )
