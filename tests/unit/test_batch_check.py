"""The same-batch fingerprint (pure): what it tells apart, when it runs, its cost."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from mpar.runtime._batch_check import EVERY, FIRST_STEPS, _due, fingerprint, mismatches


def _prints(*batches):
    return [fingerprint([(None, x, {"y": y})], [{}]) for x, y in batches]


def test_the_fingerprint_tells_other_samples_shapes_and_orders_apart():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    same = _prints((x, y), (x.clone(), y.clone()))
    assert mismatches(same, [[0, 1]]) == []
    other = _prints((x, y), (x + 1e-3, y))
    assert mismatches(other, [[0, 1]]) == [
        "ranks 0 and 1 (pipeline [0, 1]): microbatch 0 args[1]: same shape (8, 16), other values"
    ]
    swapped = _prints((x, y), (x.flip(0), y.flip(0)))  # the same samples, another order
    assert len(mismatches(swapped, [[0, 1]])) == 1
    shorter = _prints((x, y), (x[:6], y[:6]))
    assert "shape (8, 16) torch.float32 against (6, 16)" in mismatches(shorter, [[0, 1]])[0]
    # two pipelines: only the second one's ranks differ
    four = _prints((x, y), (x, y), (x, y), (x, y + 1))
    assert [m.split(":")[0] for m in mismatches(four, [[0, 1], [2, 3]])] == [
        "ranks 2 and 3 (pipeline [2, 3])"
    ]


def test_it_runs_on_the_first_steps_then_periodically():
    st = SimpleNamespace(extras={})
    due = [n for n in range(3 * EVERY + 1) if _due(st)]
    assert due == [*range(FIRST_STEPS), EVERY, 2 * EVERY, 3 * EVERY]


def test_its_cost_is_small_beside_a_step():
    tokens = torch.randint(0, 50000, (8, 4096))
    args = [(None, tokens[i : i + 1], tokens[i : i + 1]) for i in range(8)]
    fingerprint(args, [{}] * 8)
    start = time.perf_counter()
    fingerprint(args, [{}] * 8)
    assert time.perf_counter() - start < 0.05  # 16 tensors; measured 0.4 ms
