"""Unit-granular ZeRO 2/3: one unit gathered (plus one prefetched) and one unit's
gradients at a time, transparent with the whole-chunk way and the single process.

Peaks come from ``mpar.memory_report()`` after a step (``gathered_peak``,
``gradients_peak``); the oracle is the same model trained in one process on
the whole batch (fp32, AdamW).
"""

from __future__ import annotations

import pytest

from mpar.testing import run_distributed

WIDTH, LAYERS = 32, 8
LAYER_BYTES = 4 * (WIDTH * WIDTH + WIDTH)  # one Linear's fp32 parameters (split in 2 or 4)


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def _train(config, steps=2):
    import torch

    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(_mlp())
    opt = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))

    @mpar.step
    def step(m, x, y):
        loss = torch.nn.functional.mse_loss(m(x), y)
        m.backward(loss)
        return loss

    x, y = _data()
    n = 8 // mpar.dp_size()
    mine = slice(mpar.dp_rank() * n, (mpar.dp_rank() + 1) * n)
    losses = []
    for _ in range(steps):
        losses.append(step(model, x[mine], y[mine]).reduce_mean().item())
        report = mpar.memory_report()["cpu"]
        opt.step()
        opt.zero_grad()
    groups = {s: len(u.groups) for s, u in model.sharded.units.items()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mpar.shutdown()
    return {"losses": losses, "report": report, "groups": groups, "state": state}


def _reference(steps=2):
    import torch

    net = _mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-6)
    x, y = _data()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, net.state_dict()


def _check(result, reference):
    import torch

    losses, state = reference
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses))
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_gathers_two_units_at_most_and_stays_transparent(dp):
    results = run_distributed(_train, dp, args=({"zero": {"stage": 3}, "microbatches": 2},))
    reference = _reference()
    for r in results:
        _check(r, reference)
        assert r["groups"] == {0: 2 * LAYERS}  # Linear and GELU units, one group each
        # the unit being computed and the prefetched one (GELUs have nothing to gather)
        assert r["report"]["gathered_peak"] == 2 * LAYER_BYTES
        # one unit's full gradients on top of this rank's reduced shards
        shards = LAYERS * LAYER_BYTES // dp
        assert shards < r["report"]["gradients_peak"] <= shards + 2 * LAYER_BYTES


def _coarser():
    return {g: _train({"zero": {"stage": 3, "gather": g}}, steps=1) for g in (2, "chunk")}


@pytest.mark.timeout(180)
def test_coarser_groups_and_whole_chunks_hold_more():
    results = run_distributed(_coarser, 2)
    for r in results:
        # groups of 2 units: Linear+GELU, the next group prefetched
        assert r[2]["groups"] == {0: LAYERS}
        assert r[2]["report"]["gathered_peak"] == 2 * LAYER_BYTES
        assert r["chunk"]["groups"] == {}
        assert r["chunk"]["report"]["gathered_peak"] >= LAYERS * LAYER_BYTES
        assert r["chunk"]["report"]["gradients_peak"] >= LAYERS * LAYER_BYTES


@pytest.mark.timeout(240)
def test_zero2_reduces_unit_by_unit_with_checkpointing_and_offload():
    config = {
        "zero": {"stage": 2, "offload_optimizer": "cpu"},
        "microbatches": 2,
        "activation_checkpointing": True,
    }
    results = run_distributed(_train, 2, args=(config,))
    reference = _reference()
    for r in results:
        _check(r, reference)
        assert r["report"]["gathered_peak"] == 0
        assert r["report"]["gradients_peak"] <= LAYERS * LAYER_BYTES // 2 + 2 * LAYER_BYTES


def _lm_step():
    """The TinyGPT step function (next-token loss over the vocabulary of 64)."""
    import torch

    import mpar

    @mpar.step
    def step(m, x):
        logits = m(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x.reshape(-1))
        m.backward(loss)
        return loss

    return step


def _my_rows(idx):
    """This data-parallel rank's rows of the whole batch ``idx``."""
    import mpar

    n = idx.shape[0] // mpar.dp_size()
    return idx[mpar.dp_rank() * n : (mpar.dp_rank() + 1) * n]


def _gpt_layouts():
    import torch

    import mpar
    from mpar.testing.models import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab_size=64, d_model=32, num_heads=2, num_layers=6, max_seq_len=16)
    idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    for gather in ("unit", "chunk"):
        mpar.init(
            {
                "pipeline_parallel_degree": 2,
                "microbatches": 4,
                "zero": {"stage": 3, "gather": gather},
                "activation_checkpointing": gather == "unit",
            }
        )
        torch.manual_seed(0)
        model = mpar.DistributedModel(TinyGPT(cfg))
        opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        step, mine = _lm_step(), _my_rows(idx)
        losses = []
        for _ in range(2):
            losses.append(step(model, mine).reduce_mean().item())
            report = mpar.memory_report()["cpu"]
            opt.step()
            opt.zero_grad()
        sharded = model.sharded
        unit_buckets = [b for u in sharded.units.values() for g in u.groups for b in g.buckets]
        group_bytes = [
            sum(b.full.nbytes for b in g.buckets) for u in sharded.units.values() for g in u.groups
        ]
        ids = {id(b) for b in unit_buckets}
        wide = sum(b.spec.padded * 4 for b in sharded.buckets if id(b) not in ids)
        out[gather] = {
            "losses": losses,
            "gathered": report["gathered_peak"],
            "stage_bytes": sum(b.spec.padded * 4 for b in sharded.buckets),
            "groups_with_params": sum(1 for size in group_bytes if size),
            # two groups; three with checkpointing (the recomputation of a stage's
            # forward runs inside the backward of its last group, which stays gathered)
            "bound": wide + sum(sorted(group_bytes)[-3 if gather == "unit" else -2 :]),
            "groups": {s: len(u.groups) for s, u in model.sharded.units.items()},
            "state": {k: v.clone() for k, v in model.state_dict().items()},
        }
        mpar.shutdown()
    out["reference"] = _tinygpt_reference(cfg, idx)
    return out


def _tinygpt_reference(cfg, idx):
    """TinyGPT trained 2 SGD steps in one process on the whole batch (vocabulary 64)."""
    import torch

    from mpar.testing.models import TinyGPT

    torch.manual_seed(0)
    ref = TinyGPT(cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(ref(idx).reshape(-1, 64), idx.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": ref.state_dict()}


@pytest.mark.timeout(300)
def test_traced_stages_gather_by_unit_transparently():
    """TinyGPT (traced stages, embedding tied to the head across pipeline ranks) at
    pp=2 x dp=2, ZeRO-3 by unit with checkpointing and by chunk: both equal the
    single process; the unit way holds three groups at most, the chunk way all."""
    import torch

    for r in run_distributed(_gpt_layouts, 4):
        ref = r["reference"]
        assert all(count > 1 for count in r["unit"]["groups"].values())
        # stage-wide buckets (the tied embedding) and at most three groups at once
        assert r["unit"]["gathered"] <= r["unit"]["bound"] <= r["unit"]["stage_bytes"]
        if r["unit"]["groups_with_params"] > 3:  # the profiled split decides how many
            assert r["unit"]["bound"] < r["unit"]["stage_bytes"]
        assert r["chunk"]["gathered"] == r["chunk"]["stage_bytes"]
        for gather in ("unit", "chunk"):
            torch.testing.assert_close(
                torch.tensor(r[gather]["losses"]), torch.tensor(ref["losses"])
            )
            for key, value in ref["state"].items():
                torch.testing.assert_close(r[gather]["state"][key], value, rtol=1e-5, atol=1e-6)


def _embedding_layouts():
    """Untied TinyGPT at pp=1 (module hooks) and pp=2 (traced stages), ZeRO-3 by unit:
    what each embedding table's bucket holds when autograd accumulates its gradient,
    and what buffer the reduce-scatter of a one-parameter bucket sends."""
    import torch

    import mpar
    from mpar.shard._bucket import Residence
    from mpar.testing.models import GPTConfig, TinyGPT

    cfg = GPTConfig(
        vocab_size=64, d_model=32, num_heads=2, num_layers=4, max_seq_len=16, tie_embeddings=False
    )
    idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    for pp in (1, 2):
        mpar.init({"pipeline_parallel_degree": pp, "microbatches": 2, "zero": {"stage": 3}})
        torch.manual_seed(0)
        model = mpar.DistributedModel(TinyGPT(cfg))
        opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        tables: list[int] = []  # the flagged groups' sizes (elements)
        held: list[tuple[Residence, int]] = []  # a table's bucket at its gradient's arrival
        sent_grad: list[bool] = []  # a one-parameter bucket sent its .grad itself

        def watch(m, tables=tables, held=held, sent_grad=sent_grad):
            for units in m.sharded.units.values():
                for group in units.groups:
                    for bucket in group.buckets:
                        if group.unread_in_backward:
                            tables.append(bucket.spec.numel)
                            bucket.params[0].register_post_accumulate_grad_hook(
                                lambda _p, b=bucket: held.append(
                                    (b.residence, b.full.untyped_storage().nbytes())
                                )
                            )
                        if len(bucket.params) == 1 and bucket.grads.per_unit:
                            grads, start = bucket.grads, bucket.grads.start_reduce

                            def start_reduce(grads=grads, start=start, **options):
                                before = grads.params[0].grad.data_ptr()
                                start(**options)
                                sent_grad.append(grads.pending.flat.data_ptr() == before)

                            grads.start_reduce = start_reduce

        model.after_partition.append(watch)

        step, mine = _lm_step(), _my_rows(idx)
        losses = []
        for _ in range(2):
            losses.append(step(model, mine).reduce_mean().item())
            opt.step()
            opt.zero_grad()
        out[pp] = {
            "losses": losses,
            "tables": sorted(tables),
            "held": held,
            "sent_grad": sent_grad,
            "stage": mpar.pp_rank(),
            "state": {k: v.clone() for k, v in model.state_dict().items()},
        }
        mpar.shutdown()
    out["reference"] = _tinygpt_reference(cfg, idx)
    return out


@pytest.mark.timeout(300)
def test_embedding_tables_are_not_gathered_for_backward_and_reduce_without_a_copy():
    """ZeRO-3 by unit: an embedding lookup's backward reads only the indices, so its
    table is never gathered for it (the parameter has its shape, no memory, when the
    gradient arrives), and a one-parameter bucket reduce-scatters the gradient autograd
    allocated (no flat copy of it). Transparent with the single process."""
    import torch

    from mpar.shard._bucket import Residence

    for r in run_distributed(_embedding_layouts, 4):
        ref = r["reference"]
        for pp in (1, 2):
            got = r[pp]
            if got["stage"] == 0:  # both tables (token and position) are on stage 0
                assert got["tables"] == [16 * 32, 64 * 32]
                # 2 tables x 2 microbatches x 2 steps, each seen ungathered
                assert got["held"] == [(Residence.SHARDED, 0)] * 8
            else:
                assert got["tables"] == [] and got["held"] == []
            # the tables (stage 0) or the LM head (last stage), every microbatch
            assert len(got["sent_grad"]) >= 4 and all(got["sent_grad"])
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]))
            for key, value in ref["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6)


def _head_layouts():
    """Untied TinyGPT at pp=2 x dp=2, ZeRO-3 by unit, microbatches of one sequence:
    what the LM head's bucket holds whenever its weight gradient is computed (a
    matrix product of the weight's shape, seen by a dispatch mode in the second step)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import mpar
    from mpar.testing.models import GPTConfig, TinyGPT

    cfg = GPTConfig(
        vocab_size=64, d_model=32, num_heads=2, num_layers=4, max_seq_len=16, tie_embeddings=False
    )
    idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(3))
    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 4, "zero": {"stage": 3}})
    torch.manual_seed(0)
    model = mpar.DistributedModel(TinyGPT(cfg))
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    held: list[int] = []  # the head's gathered bytes at each of its weight gradients

    class Watch(TorchDispatchMode):
        def __init__(self, bucket):
            super().__init__()
            self.bucket = bucket

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and tuple(out.shape) in ((64, 32), (32, 64)):
                held.append(self.bucket.full.untyped_storage().nbytes())
            return out

    step, mine = _lm_step(), _my_rows(idx)
    losses = []
    for i in range(2):
        if i == 0:
            losses.append(step(model, mine).reduce_mean().item())
        else:  # partitioned now: the head is the last stage's (64, 32) unit bucket
            buckets = [b for u in model.sharded.units.values() for g in u.groups for b in g.buckets]
            last = mpar.pp_rank() == 1  # (the first stage's token table has that shape too)
            head = [b for b in buckets if b.shapes == ((64, 32),)] if last else []
            assert len(head) == last
            with Watch(head[0] if head else buckets[0]):
                losses.append(step(model, mine).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    out = {
        "losses": losses,
        "held": held,
        "stage": mpar.pp_rank(),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }
    mpar.shutdown()
    out["reference"] = _tinygpt_reference(cfg, idx)
    return out


@pytest.mark.timeout(300)
def test_lm_head_weight_gradient_is_computed_after_its_gathered_table_is_freed():
    """ZeRO-3 by unit: a linear layer's weight gradient (the LM head's, here) is
    computed once the gathered weight is freed, so the two never exist at once
    (the matrix product's backward would hold both). Transparent with one process."""
    import torch

    for r in run_distributed(_head_layouts, 4):
        ref = r["reference"]
        if r["stage"] == 1:  # one weight gradient per microbatch, each with nothing gathered
            assert r["held"] == [0] * 4
        else:  # (the first stage has no matrix product of that shape)
            assert r["held"] == []
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]))
        for key, value in ref["state"].items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
def test_zero3_over_one_rank_gathers_nothing_unless_parameters_are_offloaded():
    """A group of one has nothing to gather: parameters stay in place, no unit hooks,
    nothing counted as gathered; with ``offload_params`` the host shard is gathered
    unit by unit as usual. Both train as the single process does."""
    reference = _reference()
    for zero, hooked in (({"stage": 3}, False), ({"stage": 3, "offload_params": "cpu"}, True)):
        (r,) = run_distributed(_train, 1, args=({"zero": zero, "microbatches": 2},))
        _check(r, reference)
        assert bool(r["groups"]) is hooked
        assert (r["report"]["gathered_peak"] > 0) is hooked
