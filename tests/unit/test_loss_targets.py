"""Counting the targets a mean loss keeps (``mpar._targets``), and the weights they give
microbatches (``Microbatches.loss_weight``)."""

from __future__ import annotations

import pytest
import torch

from mpar._targets import count_targets, is_causal_lm
from mpar.runtime._microbatch import split_microbatches


def _step(model, batch):  # the shape of a step function: the model, then the batch
    return batch


LABELS = torch.tensor(
    [
        [1, 2, 3, -100],  # 3 kept, 2 after the shift
        [4, -100, -100, -100],  # 1 kept, 0 after the shift
        [5, 6, 7, 8],  # 4 kept, 3 after the shift
    ]
)


def test_each_microbatch_counts_its_labels_and_what_a_causal_lm_keeps():
    batches = split_microbatches(_step, (None, {"input_ids": LABELS, "labels": LABELS}), {}, 2)
    names = ["batch"]
    causal = count_targets(True, batches.args, batches.kwargs, names)
    assert causal.tolist() == [[4, 2], [4, 3]]  # [as they are, shifted by one]
    plain = count_targets(False, batches.args, batches.kwargs, names)
    assert plain.tolist() == [[4, 4], [4, 4]]


def test_labels_already_shifted_are_counted_as_they_are():
    shifted = LABELS[:, 1:]
    batch = {"input_ids": LABELS, "labels": LABELS, "shift_labels": shifted}
    batches = split_microbatches(_step, (None, batch), {}, 1)
    counts = count_targets(True, batches.args, batches.kwargs, ["batch"])
    assert counts.tolist() == [[8, 5]]


@pytest.mark.parametrize(
    "batch",
    [
        {"input_ids": LABELS},  # no labels: weighed by samples
        {"input_ids": LABELS, "labels": LABELS.float()},  # a regression's targets
    ],
)
def test_no_integer_labels_counts_nothing(batch):
    batches = split_microbatches(_step, (None, batch), {}, 3)
    assert count_targets(True, batches.args, batches.kwargs, ["batch"]) is None


def test_a_labels_argument_is_found_by_its_name():
    def step(model, input_ids, labels):
        return labels

    batches = split_microbatches(step, (None, LABELS, LABELS), {}, 3)
    counts = count_targets(False, batches.args, batches.kwargs, ["input_ids", "labels"])
    assert counts[:, 0].tolist() == [3, 1, 4]


def test_weights_are_shares_of_every_replicas_targets():
    batches = split_microbatches(_step, (None, {"labels": LABELS}), {}, 3)
    assert [round(w, 6) for w in batches.weights] == [round(1 / 3, 6)] * 3
    counts = count_targets(True, batches.args, batches.kwargs, ["batch"])
    batches.targets, batches.total_targets = counts, counts.sum(0) * 2  # two replicas alike
    assert float(batches.loss_weight(0, 2, own=False)) == pytest.approx(3 / 16)
    assert float(batches.loss_weight(1, 2, own=True)) == 0.0
    assert float(batches.loss_weight(2, 2, own=True)) == pytest.approx(3 / 10)
    batches.targets = batches.total_targets = None  # without labels: by samples over dp
    assert batches.loss_weight(0, 2, own=True) == pytest.approx(1 / 6)


def test_hugging_face_causal_lms_are_told_apart():
    transformers = pytest.importorskip("transformers")
    tiny = {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16}
    assert is_causal_lm(transformers.GPT2LMHeadModel(transformers.GPT2Config(**tiny)))
    bert = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8
    )
    assert not is_causal_lm(transformers.BertForMaskedLM(bert))
    assert not is_causal_lm(torch.nn.Linear(2, 2))
