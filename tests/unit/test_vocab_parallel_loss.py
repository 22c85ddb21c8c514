"""``vocab_parallel_cross_entropy`` on one rank is ``F.cross_entropy`` (per token, with
``ignore_index``), values and gradients; bad inputs name the problem. The split case
(tp = 2) is in tests/multiproc/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

from mpar.comm._tp_ops import TP_GROUP, clear_tp_groups, register_tp_group
from mpar.tensor_parallel import vocab_parallel_cross_entropy


@pytest.fixture
def one_rank_group():
    register_tp_group(TP_GROUP, None, 1, 0)
    yield
    clear_tp_groups()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_is_the_plain_cross_entropy(one_rank_group, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (10 * torch.randn(3, 5, 11, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, 1] = labels[2, 4] = -100
    mine = vocab_parallel_cross_entropy(logits, labels)
    want = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
    assert mine.dtype == torch.float32 and mine.shape == labels.shape
    assert_close(mine, want)
    weights = torch.rand(3, 5, generator=g)
    (got,) = torch.autograd.grad((mine * weights).sum(), logits)
    (ref,) = torch.autograd.grad((want * weights).sum(), logits)
    assert got.dtype == dtype
    assert_close(got, ref)
    assert got[0, 1].abs().sum() == 0  # an ignored token gets no gradient


def test_bad_inputs(one_rank_group):
    logits = torch.zeros(2, 3, 7)
    with pytest.raises(ValueError, match=r"labels must have the logits' shape without the last"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer dtype"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3))


@pytest.mark.parametrize("cp_first", [True, False])
def test_under_context_parallelism_the_shift_wraps_the_vocab_parallel_loss(
    one_rank_group, cp_first
):
    """cp x tp on a Hugging Face causal LM: CP's label shift over the whole sequence
    stays outermost and TP's vocabulary-parallel loss goes inside it, whichever is
    installed first; the head is still found through CP's wrapper; on one rank the
    loss is Hugging Face's."""
    import functools

    from mpar.context_parallel._shard import CallPlan, ShiftedOverCP
    from mpar.tensor_parallel import STYLES
    from mpar.tensor_parallel._vocab import causal_lm_loss, use_vocab_parallel_loss, vocab_plan
    from tests.multiproc._cp_cases import VOCAB, build

    model = build("llama")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids).loss
    if cp_first:
        CallPlan(model)
    assert vocab_plan(model, 2) == {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise"}
    assert use_vocab_parallel_loss(model, {"lm_head": STYLES["colwise"]}, TP_GROUP)
    if not cp_first:
        CallPlan(model)
    loss = model.loss_function
    assert isinstance(loss, ShiftedOverCP)
    assert isinstance(loss.__wrapped__, functools.partial)
    assert loss.__wrapped__.func is causal_lm_loss
    assert_close(model(input_ids=ids, labels=ids).loss, want)
