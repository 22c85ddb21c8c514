"""StepOutput reductions."""

from __future__ import annotations

import pytest
import torch

from mpar.errors import StepError
from mpar.runtime._output import StepOutput, check_gatherable


def test_reductions_weighted_by_microbatch_size():
    out = StepOutput([torch.tensor(1.0), torch.tensor(4.0)], sizes=[3, 1])
    assert out.reduce_mean().item() == pytest.approx(1.75)
    assert out.reduce_sum().item() == 5.0
    assert out.concat().tolist() == [1.0, 4.0]  # scalars are stacked
    assert out.stack().shape == (2,)


def test_integer_and_bool_means_are_weighted_as_numbers_are():
    # before: torch.stack(...).double().mean(), unweighted (2.5 here) where ints gave 1.75
    for values in ([torch.tensor(1), torch.tensor(4)], [1, 4]):
        mean = StepOutput(values, sizes=[3, 1]).reduce_mean()
        assert float(mean) == pytest.approx(1.75)
    flags = StepOutput([torch.tensor(True), torch.tensor(False)], sizes=[1, 3]).reduce_mean()
    assert flags.dtype == torch.float64 and flags.item() == pytest.approx(0.25)


def test_dict_fields_and_concat_of_batches():
    outputs = [
        {"loss": torch.tensor(2.0), "logits": torch.ones(3, 2)},
        {"loss": torch.tensor(4.0), "logits": torch.zeros(2, 2)},
    ]
    out = StepOutput(outputs, sizes=[3, 2])
    assert out["loss"].reduce_mean().item() == pytest.approx(2.8)
    assert out["logits"].concat().shape == (5, 2)
    assert out[1]["loss"].item() == 4.0
    assert len(out) == 2
    assert StepOutput([1.0, 3.0], [1, 1]).reduce_mean() == 2.0


def test_ungatherable_values_are_named():
    check_gatherable({"a": [torch.zeros(1), 1, "s", None]})
    with pytest.raises(StepError, match=r"\['a'\]\[1\] is a set"):
        check_gatherable({"a": [1, {2}]})


def test_a_token_mean_loss_is_weighed_by_kept_targets():
    # microbatch means 1.0 over 30 targets and 4.0 over 10: the batch's mean is 1.75,
    # whatever the microbatches' numbers of samples (sizes alone would give 2.5)
    losses = [torch.tensor(1.0), torch.tensor(4.0)]
    out = StepOutput(losses, sizes=[2, 2], targets=torch.tensor([30, 10]))
    assert out.targets == [30, 10]
    assert out.reduce_mean().item() == pytest.approx(1.75)
    assert out[0].item() == 1.0
    fields = StepOutput([{"loss": t} for t in losses], sizes=[2, 2], targets=[30, 10])
    assert fields["loss"].reduce_mean().item() == pytest.approx(1.75)


def test_a_microbatch_without_targets_weighs_nothing():
    # its own mean is 0/0 (NaN in Hugging Face's loss); the batch's mean is finite
    out = StepOutput([torch.tensor(2.0), torch.tensor(float("nan"))], [2, 2], targets=[5, 0])
    assert out.reduce_mean().item() == 2.0
    # no target anywhere: weighed by samples again (NaN, as one process's loss is)
    none = StepOutput([torch.tensor(float("nan"))] * 2, [2, 2], targets=[0, 0])
    assert none.reduce_mean().isnan()
