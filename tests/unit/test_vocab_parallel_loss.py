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
