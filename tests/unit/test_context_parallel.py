"""Context parallelism's pure parts: the token layout, its balance, block attention and
its masks, the batch sharding and the output combination (no processes)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from mpar import _attention_blocks as blocks
from mpar._cp_context import (
    CPContext,
    Piece,
    TokenLayout,
    balanced_layout,
    causal_work,
    document_ids,
    imbalance,
    natural_pieces,
)
from mpar.config import config_from_dict
from mpar.context_parallel import combine, shard_batches
from mpar.errors import ConfigError, ContextParallelError


def test_head_tail_layout_gives_each_rank_a_head_and_a_tail_chunk():
    layout = TokenLayout(16, 2)
    assert layout.runs(0) == [(0, 4), (12, 4)] and layout.runs(1) == [(4, 4), (8, 4)]
    assert layout.index(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    x = torch.arange(32).view(2, 16)
    pieces = [layout.shard(x, r) for r in range(2)]
    assert pieces[1][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(layout.unshard(pieces), x)
    segmented = TokenLayout(16, 2, segments=2)  # chunks 0 and 3 of each half
    assert segmented.runs(0) == [(0, 2), (6, 2), (8, 2), (14, 2)]
    with pytest.raises(ValueError, match="does not cut into"):
        TokenLayout(12, 4)


def test_head_tail_balances_causal_work_exactly():
    for cp in (2, 4, 8):
        work = causal_work(TokenLayout(64, cp), None)
        assert len(set(work)) == 1  # every rank the same (query, key) pairs


def test_packed_documents_are_balanced_within_ten_percent():
    """One long document then short ones: plain head-tail gives the rank holding the
    long document's middle far more work; the chosen layout spreads every document."""
    length, cp = 64, 2
    positions = torch.cat([torch.arange(32), torch.arange(8), torch.arange(8), torch.arange(16)])
    documents = document_ids(positions.unsqueeze(0))
    assert documents is not None and documents[0, -1] == 3
    assert imbalance(causal_work(TokenLayout(length, cp), documents)) > 0.10
    layout = balanced_layout(length, cp, documents)
    assert layout.segments > 1
    assert imbalance(causal_work(layout, documents)) <= 0.10
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # random packings of 4 rows
        rows = []
        for _ in range(4):
            cuts = sorted(torch.randperm(127, generator=g)[:5].add(1).tolist())
            rows.append(torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, 128])]))
        docs = document_ids(torch.stack(rows))
        assert imbalance(causal_work(balanced_layout(128, 4, docs), docs)) <= 0.10
    assert document_ids(torch.arange(8).expand(3, 8)) is None  # no packing: one per row


def _reference(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_blocks_merge_to_whole_attention_and_back(kernel):
    """Attention computed key block by key block and merged by log-sum-exp equals the
    whole attention; block gradients from the final out and lse sum to its gradients
    (grouped-query heads, a row that sees nothing, a causal block)."""
    fused = kernel == "fused"
    torch.manual_seed(0)
    b, h, hkv, s, d = 2, 4, 2, 12, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, s, d, requires_grad=True) for _ in range(2))
    mask = (torch.rand(b, 1, s, s) > 0.3) & torch.ones(s, s, dtype=torch.bool).tril()
    mask[0, 0, 3] = False  # a row that sees nothing
    want = _reference(q, k, v, mask, 0.3)
    dout = torch.randn_like(want)
    want.backward(dout)
    out, lse = torch.zeros(b, h, s, d), torch.full((b, h, s), -math.inf)
    spans = [slice(0, 4), slice(4, 8), slice(8, 12)]
    for cols in spans:
        o, l_ = blocks.block_forward(q.detach(), k[:, :, cols].detach(), v[:, :, cols].detach(),
                                     mask[..., cols], 0.3, fused=fused)  # fmt: skip
        blocks.merge_into(out, lse, o, l_)
    assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for cols in spans:
        a, b_, c = blocks.block_backward(dout, q.detach(), k[:, :, cols].detach(),
                                         v[:, :, cols].detach(), out, lse, mask[..., cols], 0.3,
                                         fused=fused)  # fmt: skip
        dq += a
        dk[:, :, cols] += b_
        dv[:, :, cols] += c
    for mine, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    o, l_ = blocks.block_forward(
        q.detach(), k.detach(), v.detach(), blocks.CAUSAL, 0.3, fused=fused
    )
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
    assert_close(o, _reference(q, k, v, causal, 0.3).detach(), atol=1e-5, rtol=1e-5)


def _elementwise(ctx, q, k, causal, window):
    qi, ki = q.index.view(-1, 1), k.index.view(1, -1)
    allowed = torch.ones(q.length, k.length, dtype=torch.bool)
    if causal:
        allowed &= ki <= qi
    if window:
        allowed &= ki > qi - window
    allowed = allowed.view(1, 1, q.length, k.length)
    if ctx.documents is not None:
        d = ctx.documents
        allowed = allowed & (d[:, q.index].unsqueeze(-1) == d[:, k.index].unsqueeze(-2)).unsqueeze(
            1
        )
    if ctx.valid is not None:
        allowed = allowed & ctx.valid[:, k.index].view(-1, 1, 1, k.length)
    return allowed


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(("causal", "window"), [(True, 0), (False, 0), (True, 5)])
def test_block_masks_are_the_elementwise_masks(masked, causal, window):
    length, cp = 32, 2
    positions = torch.arange(length).expand(2, length).clone()
    documents = valid = None
    if masked:
        positions[0, 10:] = torch.arange(length - 10)
        documents = document_ids(positions)
        valid = torch.ones(2, length, dtype=torch.bool)
        valid[1, -5:] = False
    layout = balanced_layout(length, cp, documents)
    ctx = CPContext(layout, 0, positions, documents, valid)
    for r in range(cp):
        for k in layout.pieces(r):
            for q in layout.pieces(0):
                mask = ctx.block(q, k, causal, window)
                want = _elementwise(ctx, q, k, causal, window)
                if mask is None:
                    assert not want.any()
                elif isinstance(mask, str):
                    got = torch.ones(q.length, k.length, dtype=torch.bool)
                    got = got.tril() if mask == blocks.CAUSAL else got
                    assert torch.equal(got.expand_as(want[0, 0]), want[0, 0]) and want.all(0).equal(
                        want.any(0)
                    )
                else:
                    assert torch.equal(mask.expand_as(want), want.expand_as(mask))
    assert [p.length for p in natural_pieces(3000, masked=True)] == [1024, 1024, 952]
    assert isinstance(natural_pieces(3000, masked=False)[0], Piece)


def test_config_keys_and_their_errors():
    cfg = config_from_dict({"cp": 2, "context_parallel_method": "all_to_all"})
    assert cfg.context_parallel_degree == 2 and cfg.context_parallel_method == "all_to_all"
    with pytest.raises(ConfigError, match="context_parallel_method"):
        config_from_dict({"context_parallel_method": "ulysses"})
    with pytest.raises(ConfigError, match="context_parallel_degree"):
        config_from_dict({"cp": 0})
    with pytest.raises(ConfigError, match="'context_parallel_degree' 4 .* do not divide"):
        config_from_dict({"cp": 4, "pipeline_parallel_degree": 2}).check_world_size(6)
    with pytest.raises(ConfigError, match="leaves 2 data-parallel"):
        config_from_dict({"cp": 2, "ddp": False}).check_world_size(4)
    # the planner models cp: 'auto' values are resolved at the first step like any
    auto = config_from_dict({"cp": 2, "microbatches": "auto", "device_memory": "1GiB"})
    assert auto.auto_keys == ("microbatches",)


def _batch(length=16):
    ids = torch.arange(2 * length).view(2, length)
    return {"input_ids": ids, "labels": ids.clone(), "flags": torch.ones(2, 3)}


def test_sharding_a_batch_keeps_each_ranks_tokens_and_weighs_its_labels():
    batch = _batch()
    batch["labels"][:, 8:] = -100  # rank 0 holds 4 + 0 valid labels per row, rank 1 4
    _args, kwargs, contexts = shard_batches([()], [batch], [], 2, 1)
    piece = kwargs[0]
    assert piece["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert piece["flags"].shape == (2, 3)  # not a sequence: passed whole
    assert contexts[0].loss_weight == 0.5 and contexts[0].positions.shape == (1, 16)
    _, _, zero = shard_batches([()], [batch], [], 2, 0)
    assert zero[0].loss_weight == 0.5
    batch["labels"][:, 4:] = -100  # every valid label on rank 0
    assert shard_batches([()], [batch], [], 2, 0)[2][0].loss_weight == 1.0
    positional, _, _ = shard_batches([(batch["input_ids"],)], [{}], ["input_ids"], 2, 0)
    assert positional[0][0].shape == (2, 8)


def test_sharding_errors_name_the_length_and_the_fix():
    with pytest.raises(ContextParallelError, match=r"sequence length 18 .* 2 x .* = 4.* to 20"):
        shard_batches([()], [_batch(18)], [], 2, 0)
    bad = _batch()
    bad["attention_mask"] = torch.ones(2, 1, 16)
    with pytest.raises(ContextParallelError, match="attention_mask of shape"):
        shard_batches([()], [bad], [], 2, 0)
    with pytest.raises(ContextParallelError, match="none of them has two axes"):
        shard_batches([()], [{"x": torch.ones(4)}], [], 2, 0)


def test_combining_outputs_gives_the_whole_sequence_and_the_weighted_loss():
    layout = TokenLayout(8, 2)
    ctx = CPContext(layout, 0, torch.arange(8).unsqueeze(0))
    whole = torch.arange(16.0).view(2, 8)
    pieces = [
        ({"loss": torch.tensor(2.0), "logits": layout.shard(whole, r), "n": r}, w)
        for r, w in ((0, 0.25), (1, 0.75))
    ]
    pieces[1][0]["loss"] = torch.tensor(4.0)
    out = combine(pieces, ctx)
    assert out["loss"].item() == pytest.approx(0.25 * 2 + 0.75 * 4)
    assert torch.equal(out["logits"], whole) and out["n"] == 0


def test_a_hugging_face_model_with_attention_of_its_own_is_refused_when_wrapped():
    """Falcon's attention is its own code (eager unless _attn_implementation is "sdpa"):
    pointed at mpar's attention it failed inside transformers ('Tensor + NoneType')."""
    hf = pytest.importorskip("transformers")
    from mpar.context_parallel import install_hf

    small = dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    falcon = hf.FalconForCausalLM(hf.FalconConfig(**small))
    with pytest.raises(ContextParallelError, match="FalconForCausalLM computes attention"):
        install_hf(falcon, "ring")
    llama = hf.LlamaForCausalLM(hf.LlamaConfig(**small, intermediate_size=32))
    assert install_hf(llama, "ring")
    assert llama.config._attn_implementation == "mpar_cp_ring"
