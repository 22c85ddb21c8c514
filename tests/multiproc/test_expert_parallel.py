"""Expert parallelism is transparent: the same losses (balance loss included), global
gradient norms and updated parameters as one process on the whole batch.

The oracle is in ``_moe_cases`` (one process running the batch in the chunks the
data-parallel ranks' microbatches make). The default suite runs Mixtral at ep=2 (with
its per-rank expert bytes, and the dispatch bytes against the documented formula), a
user's MoE model placed by ``ep_plan`` (per-expert and fused), a checkpoint saved at
ep=2 resumed at ep=4 and ep=1, and transformers' Mixtral files trained at ep=2 x pp=2
and saved back; ``-m slow`` adds Qwen2-MoE and Qwen3-MoE (also at pp=2), ZeRO-3 with
offload, ep=2 x tp=2, ep=4, activation checkpointing and pipelines of the user's model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc import _moe_cases as cases

pytest.importorskip("transformers")

STEPS = 2
USER_PLAN = {"ep_plan": {"blocks.*.experts": "experts"}}


def _run(families: list[str], world: int, config: dict[str, Any], timeout: int = 300) -> None:
    results = run_distributed(
        cases.train_ranks, world, args=(families, config, STEPS), timeout=timeout
    )
    pp, tp = config.get("pipeline_parallel_degree", 1), config.get("tensor_parallel_degree", 1)
    cases.check(results, families, world // (pp * tp), config.get("microbatches", 1), STEPS)


def _expert_bytes(family: str) -> int:
    """Bytes of every expert's parameters of the whole model (what ep=1 holds)."""
    from mpar.expert_parallel import find_experts

    model = cases.build(family)
    found = find_experts(model, None)
    return sum(
        p.numel() * p.element_size()
        for name in found
        for p in model.get_submodule(name).parameters()
    )


def _body_traffic() -> dict[str, Any]:
    """Mixtral at ep=2: train, counting every all-to-all's bytes to other ranks as they
    are handed to torch.distributed, and recording each router's choices."""
    import torch.distributed as dist

    import mpar

    mpar.init({"expert_parallel_degree": 2, "microbatches": 2})
    model, opt = cases.wrap("mixtral")
    routes: list[torch.Tensor] = []
    for module in model.module.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda m, i, out: routes.append(out[2].detach().clone()))
    wire = [0]
    real = dist.all_to_all_single

    def counted(
        out: Any, inp: Any, out_splits: Any = None, in_splits: Any = None, **kw: Any
    ) -> Any:
        size, me = dist.get_world_size(kw.get("group")), dist.get_rank(kw.get("group"))
        splits = in_splits or [inp.shape[0] // size] * size
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        wire[0] += (sum(splits) - splits[me]) * row
        return real(out, inp, out_splits, in_splits, **kw)

    dist.all_to_all_single = counted
    try:
        losses, norms = cases.run_steps(model, opt, range(STEPS))
    finally:
        dist.all_to_all_single = real
    experts = model.stages.expert_params
    held = sum(p.numel() * p.element_size() for p in model.local_parameters() if id(p) in experts)
    return {"losses": torch.stack(losses), "norms": torch.tensor(norms), "state": model.state_dict(),
            "wire": wire[0], "routes": routes, "expert_bytes": held}  # fmt: skip


def _formula(routes: list[list[torch.Tensor]], rank: int, ep: int = 2) -> int:
    """docs/expert_parallel.md: per MoE call, (pairs out + pairs in) x (2 H b + w) bytes
    of rows, and (ep - 1) x E/ep counts of 8 bytes."""
    hidden, b, w, local = 32, 4, 4, cases.EXPERTS // ep
    total = 0
    for call in range(len(routes[rank])):
        out = int((routes[rank][call] // local != rank).sum())
        into = sum(int((routes[s][call] // local == rank).sum()) for s in range(ep) if s != rank)
        total += (out + into) * (2 * hidden * b + w) + (ep - 1) * local * 8
    return total


@pytest.mark.timeout(300)
def test_mixtral_ep2_is_transparent_halves_expert_bytes_and_sends_the_formulas_bytes():
    results = run_distributed(_body_traffic, 2, timeout=280)
    cases.check([{"mixtral": r} for r in results], ["mixtral"], 2, 2, STEPS)
    whole = _expert_bytes("mixtral")
    assert [r["expert_bytes"] for r in results] == [whole // 2, whole // 2]
    routes = [r["routes"] for r in results]
    assert len(routes[0]) == STEPS * 2 * 2  # steps x microbatches x MoE layers
    for rank, r in enumerate(results):
        want = _formula(routes, rank)
        assert want > 0 and abs(r["wire"] - want) <= 0.05 * want, (rank, r["wire"], want)


@pytest.mark.slow  # the Hugging Face checkpoint test below trains Mixtral at ep2 x pp2
@pytest.mark.timeout(300)
def test_mixtral_ep2_pp2():
    _run(["mixtral"], 4, {"expert_parallel_degree": 2, "pipeline_parallel_degree": 2,
                          "microbatches": 2})  # fmt: skip


@pytest.mark.timeout(300)
def test_a_users_moe_is_placed_by_ep_plan():
    """``TinyMoE``'s router is a parameter of its block: its experts modules (a list of
    experts, or fused weights) are named by ``ep_plan``."""
    _run(list(cases.USER), 2, {"expert_parallel_degree": 2, "microbatches": 2, **USER_PLAN})


EP2 = {"expert_parallel_degree": 2, "microbatches": 2}
SLOW = [
    (2, ["qwen2_moe", "qwen3_moe"], EP2),
    (4, ["qwen2_moe", "qwen3_moe"], {**EP2, "pipeline_parallel_degree": 2}),
    (
        4,
        ["mixtral", "qwen2_moe"],
        {**EP2, "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}},
    ),
    # Qwen3-MoE's own TP plan: q_norm / k_norm 'replicated_with_grad_allreduce'
    (4, ["mixtral", "qwen2_moe", "qwen3_moe"], {**EP2, "tensor_parallel_degree": 2}),
    (4, ["mixtral"], {"expert_parallel_degree": 4}),
    (4, ["mixtral"], {**EP2, "zero": {"stage": 2}, "activation_checkpointing": True}),
    (
        4,
        list(cases.USER),
        {**EP2, "pipeline_parallel_degree": 2, "pipeline": "zero_bubble", **USER_PLAN},
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world", "families", "config"), SLOW)
def test_expert_parallel_grid(world, families, config):
    _run(families, world, config, timeout=880)


# -- checkpoints key experts by their global index ----------------------------------------


def _body_reshard(root: str) -> dict[str, Any]:
    """For each form of the user's experts: save at ep=2 (ZeRO-1) after one step and
    train on; resume at ep=4 (ZeRO-2) and at ep=1 (ZeRO-3: the experts sharded over
    every data-parallel rank) and train the same step."""
    import mpar

    config = {"microbatches": 2, **USER_PLAN}
    out: dict[str, Any] = {}
    for family in cases.USER:
        path = f"{root}/{family}"
        mpar.init({**config, "expert_parallel_degree": 2, "zero": {"stage": 1}})
        model, opt = cases.wrap(family)
        cases.run_steps(model, opt, range(1))
        mpar.save_checkpoint(path, model, opt)
        _, norms = cases.run_steps(model, opt, range(1, 2))
        out[family, "saved"] = (norms, model.state_dict())
        for ep, stage in ((4, 2), (1, 3)):
            mpar.shutdown()
            mpar.init({**config, "expert_parallel_degree": ep, "zero": {"stage": stage}})
            model, opt = cases.wrap(family)
            mpar.load_checkpoint(path, model, opt)
            _, norms = cases.run_steps(model, opt, range(1, 2))
            out[family, f"ep{ep}"] = (norms, model.state_dict())
        mpar.shutdown()
    return out


@pytest.mark.timeout(400)
def test_a_checkpoint_saved_at_ep2_resumes_at_ep4_and_ep1(tmp_path):
    """The model and the optimizer's momentum come back whole in other layouts, for
    experts held per expert (each rank lists its own) and fused (each rank its rows):
    the step after the resume equals the uninterrupted one."""
    for r in run_distributed(_body_reshard, 4, args=(str(tmp_path),), timeout=380):
        for family in cases.USER:
            norms, state = r[family, "saved"]
            for layout in ("ep4", "ep1"):
                got_norms, got_state = r[family, layout]
                where = f"{family} resumed at {layout}"
                torch.testing.assert_close(got_norms, norms, rtol=1e-6, atol=1e-7, msg=where)
                for name, tensor in state.items():
                    torch.testing.assert_close(
                        got_state[name], tensor, rtol=1e-6, atol=1e-7, msg=f"{where}: {name}"
                    )


# -- Hugging Face checkpoints -------------------------------------------------------------


def _body_pretrained(src: str, out: str) -> dict[str, Any]:
    """A Mixtral partitioned at ep=2 x pp=2 loads transformers' per-expert files
    (recording the keys this rank reads), trains, and saves with mpar.save_pretrained."""
    import mpar
    from mpar.checkpoint._safetensors import Checkpoint

    mpar.init({"expert_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2})
    read: set[str] = set()
    real = Checkpoint.read

    def recorded(self: Any, key: str, start: int, stop: int) -> torch.Tensor:
        read.add(key)
        return real(self, key, start, stop)

    Checkpoint.read = recorded  # type: ignore[method-assign]
    model, opt = cases.wrap("mixtral", eager=True)
    mpar.load_pretrained(model, src)  # partitioned: this rank's share only
    losses, norms = cases.run_steps(model, opt, range(STEPS))
    Checkpoint.read = real  # type: ignore[method-assign]
    mpar.save_pretrained(model, out)
    return {"losses": torch.stack(losses), "norms": torch.tensor(norms), "read": read,
            "state": model.state_dict(), "ranks": (mpar.pp_rank(), mpar.ep_rank())}  # fmt: skip


@pytest.mark.timeout(400)
def test_transformers_mixtral_checkpoint_trains_at_ep2_pp2_and_saves_back(tmp_path):
    """transformers writes Mixtral's experts per expert (``block_sparse_moe.experts.{e}.w1``);
    each rank reads its own experts only (rows of the fused ``gate_up_proj`` and
    ``down_proj``), trains as one process from ``from_pretrained`` does, and its
    ``save_pretrained`` (fused keys, each rank writing its rows) loads back in
    transformers with no missing or unexpected key."""
    import transformers

    torch.manual_seed(5)
    source = cases.build("mixtral")
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # values no fresh build has
    source.save_pretrained(tmp_path / "src")
    results = run_distributed(
        _body_pretrained, 4, args=(str(tmp_path / "src"), str(tmp_path / "out")), timeout=380
    )
    net = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "src")
    cases.check([{"mixtral": r} for r in results], ["mixtral"], 2, 2, STEPS, net=net)
    for r in results:
        pp_rank, ep_rank = r["ranks"]
        experts = {k.split(".experts.")[1].split(".")[0] for k in r["read"] if ".experts." in k}
        assert experts == ({"0", "1"} if ep_rank == 0 else {"2", "3"}), (r["ranks"], experts)
        layers = {k.split(".layers.")[1].split(".")[0] for k in r["read"] if ".layers." in k}
        assert layers == {str(pp_rank)}, (r["ranks"], layers)  # and its stage's layers only
    back, info = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, tensor in back.state_dict().items():
        torch.testing.assert_close(tensor, results[0]["state"][name], rtol=0, atol=0, msg=name)
