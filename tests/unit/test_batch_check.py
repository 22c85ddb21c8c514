"""The same-batch fingerprint (pure): what it tells apart, when it runs, its cost."""

from __future__ import annotations

import torch

from mpar.runtime._batch_check import EVERY, FIRST_STEPS, batch_check_due, fingerprint, mismatches


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
    due = [n for n in range(3 * EVERY + 1) if batch_check_due(n)]
    assert due == [*range(FIRST_STEPS), EVERY, 2 * EVERY, 3 * EVERY]


def test_a_replica_is_a_pipeline_with_its_tensor_parallel_ranks():
    from mpar.runtime._batch_check import replicas
    from mpar.topology import Grid

    assert replicas(Grid(4, 2)) == [[0, 1], [2, 3]]  # pp 2 x dp 2, cluster placement
    assert replicas(Grid(4, 2, placement="spread")) == [[0, 2], [1, 3]]
    assert replicas(Grid(8, 2, tp_size=2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replicas(Grid(4, 1, tp_size=2)) == [[0, 1], [2, 3]]  # TP alone: one batch per group


def test_a_fingerprint_reads_the_host_once_per_device():
    from mpar import _device

    args = [(torch.randn(4, 8), torch.arange(4)) for _ in range(8)]
    _device.SYNCS.take()
    prints = fingerprint(args, [{} for _ in args])
    assert _device.SYNCS.take() == {"batch check fingerprints": 1}
    assert len(prints) == 16 and prints[0][1] == (4, 8)
    again = fingerprint([(a.clone(), b.clone()) for a, b in args], [{} for _ in args])
    assert again == prints  # the same batch, the same fingerprint
