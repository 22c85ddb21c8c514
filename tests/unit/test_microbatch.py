"""Splitting step arguments into microbatches (pure: no processes)."""

from __future__ import annotations

import pytest
import torch

from mpar.errors import StepError
from mpar.runtime._microbatch import split_microbatches


def step_fn(model, x, batch, mask=None, *, scale=1.0):
    return None


def test_nested_tensors_split_and_uneven_sizes():
    x = torch.arange(10).reshape(10, 1)
    batch = {"ids": torch.arange(10), "pair": (torch.zeros(10, 2), "tag"), "list": [torch.ones(10)]}
    mb = split_microbatches(step_fn, ("MODEL", x, batch), {"scale": 2.0}, 4)
    assert mb.sizes == [3, 3, 2, 2]
    assert mb.weights == [0.3, 0.3, 0.2, 0.2]
    assert [a[0].shape[0] for a in mb.args] == [3, 3, 2, 2]
    assert mb.args[1][1]["pair"][1] == "tag"  # non-tensor leaves pass whole
    assert torch.equal(torch.cat([a[1]["ids"] for a in mb.args]), torch.arange(10))
    assert all(kw == {"scale": 2.0} for kw in mb.kwargs)
    assert all("MODEL" not in a for a in mb.args)  # the model is not among the split args


def test_non_split_inputs_and_axes():
    x = torch.zeros(4, 6)
    mask = torch.ones(3, 3)
    mb = split_microbatches(
        step_fn,
        ("M", x, torch.zeros(2, 6)),
        {"mask": mask},
        3,
        non_split_inputs=["mask"],
        input_split_axes={"x": 1, "batch": 1},
    )
    assert [a[0].shape for a in mb.args] == [torch.Size([4, 2])] * 3
    assert all(a[2] is mask for a in mb.args)  # passed whole (bound positionally)


@pytest.mark.parametrize(
    ("args", "kwargs", "options", "message"),
    [
        (("M", torch.zeros(3, 1), torch.zeros(3)), {}, {}, "smaller than microbatches=4"),
        (("M", torch.zeros(8, 1), torch.zeros(6)), {}, {}, "different batch sizes"),
        (("M", torch.zeros(8, 1), torch.tensor(1.0)), {}, {}, "0-dimensional"),
        (("M", torch.zeros(8), torch.zeros(8)), {}, {"input_split_axes": {"x": 2}}, "axis 2"),
        (("M", torch.zeros(8), torch.zeros(8)), {}, {"non_split_inputs": ["nope"]}, "'nope'"),
        (("M", 1, 2), {}, {}, "no tensor to split"),
    ],
)
def test_bad_inputs(args, kwargs, options, message):
    with pytest.raises(StepError, match=message):
        split_microbatches(step_fn, args, kwargs, 4, **options)


def test_wrong_arguments_are_a_type_error():
    with pytest.raises(TypeError, match="wrong arguments"):
        split_microbatches(step_fn, ("M",), {}, 2)
