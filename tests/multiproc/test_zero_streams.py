"""ZeRO's overlap on side streams, recorded on the CPU, and its knobs' transparency.

The stream seam (``mpar._streams``) is a no-op on the CPU; ``mpar.testing.streams``
records what a CUDA run would do with it. From that record, at ZeRO-3 with offload:

* the compute stream waits for a gather only inside the hook of the unit group that
  reads it (or when the optimizer re-publishes, or the user reads the parameters),
  never for a prefetch of another unit; a prefetch freed unused is settled at the end
  of the step's schedule, before the optimizer writes the shard it reads;
* at most ``zero.prefetch`` gathers are in flight ahead of the group computing, and
  the budget is used;
* an offloaded shard's gather waits (on the gather stream) for its copy-in only;
* a reduce-scatter is fenced behind the gradients computed so far, runs on its own
  stream, and the compute stream waits for it only at the end of the step, where the
  optimizer reads it; ``zero.reduce: "step"`` reduces each bucket once a step,
  ``"microbatch"`` once per microbatch;
* an offloaded gradient is copied to the host per bucket on the ``copy_out`` stream
  from the backward, right behind the bucket's last reduction of the step;
* without clipping (which reads every gradient first), the host optimizer steps the
  buckets in the backward's order, each once the host has waited for its own copy:
  the first ones step while the last ones still copy, one wait in the ledger a step.

Every recorded run also trains as one process does (fp32, against the whole batch),
and ``zero.reduce: "step"`` is checked at pp 2 x dp 2 under the NCCL-rules transport.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import reference, train_ranks
from tests.multiproc._stream_cases import recorded_training

TOL = {"rtol": 1e-5, "atol": 1e-6}
OFFLOAD = {"offload_optimizer": "cpu", "offload_params": "cpu"}
Record = tuple[str, str, str]


def _assert_transparent(results: list[dict], steps: int, clip: float | None = 0.5) -> None:
    ref = reference("mlp", "adamw", steps, clip=clip)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for name, tensor in ref["state"].items():
            torch.testing.assert_close(r["state"][name], tensor, **TOL, msg=name)


def _placed(log: list[Record]) -> Iterator[tuple[str | None, Record]]:
    """Each record with the mark it happens under (None outside any)."""
    where: str | None = None
    for op, stream, label in log:
        if op == "mark":
            where = None if label == "end" else label
        else:
            yield where, (op, stream, label)


def _check_gathers(log: list[Record], prefetch: int) -> None:
    in_flight: set[str] = set()
    dropped: set[str] = set()  # freed unused: settled when the step's schedule ends
    ahead = []
    for where, (op, stream, label) in _placed(log):
        kind, _, bucket = label.partition(":")
        if op == "issue" and stream == "gather":
            in_flight.add(label)
        elif op == "wait" and kind == "gather" and stream == "gather":
            in_flight.discard(bucket)
            dropped.add(bucket)
        elif op == "wait" and kind == "gather":
            in_flight.discard(bucket)
            if where == "finish_grads":
                assert bucket in dropped, f"compute waits for {bucket} at the end of the step"
                dropped.discard(bucket)
            elif stream == "compute" and where not in ("publish", "read"):
                assert where is not None and where.startswith("run "), (where, label)
                assert bucket in where[4:].split("|"), f"compute waits for {bucket} in {where}"
        if where is not None and where.startswith("run ") and where != "run ":
            ahead.append(len(in_flight - set(where[4:].split("|"))))
    assert max(ahead) == prefetch, (max(ahead), prefetch)


def _check_copy_in_then_gather(log: list[Record]) -> None:
    plain = [r for r in log if r[0] != "mark" and r[0] != "keep"]
    gathers = [i for i, r in enumerate(plain) if r[:2] == ("issue", "gather")]
    assert gathers
    for i in gathers:
        bucket = plain[i][2]
        assert plain[i - 1] == ("wait", "gather", f"copy_in:{bucket}"), plain[i - 2 : i + 1]
        assert plain[i - 2] == ("issue", "copy_in", bucket), plain[i - 2 : i + 1]


def _check_reductions(log: list[Record]) -> collections.Counter[str]:
    plain = [(w, r) for w, r in _placed(log) if r[0] != "keep"]
    issued: collections.Counter[str] = collections.Counter()
    for i, (where, (op, stream, label)) in enumerate(plain):
        if op == "issue" and stream == "reduce":
            issued[label] += 1
            assert plain[i - 1][1] == ("fence", "reduce", label), plain[i - 1]
        if op == "wait" and label.startswith("reduce:"):
            assert stream != "compute" or where == "finish_grads", (where, label)
    return issued


def _check_copies_out(log: list[Record], steps: int) -> None:
    """Each bucket's offloaded gradient goes to the host once a step, from the backward
    (outside the end-of-step wait), right behind its last reduction; compute waits for
    it at the end of the step only."""
    plain = [(w, r) for w, r in _placed(log) if r[0] != "keep"]
    copied: collections.Counter[str] = collections.Counter()
    for i, (where, (op, stream, label)) in enumerate(plain):
        if op == "issue" and stream == "copy_out":
            copied[label] += 1
            assert where != "finish_grads", label
            assert plain[i - 1][1] == ("wait", "copy_out", f"reduce:{label}"), plain[i - 1]
        if op == "wait" and label.startswith("copy_out:"):
            assert stream == "compute" and where == "finish_grads", (where, stream, label)
    assert copied and set(copied.values()) == {steps}, copied


@pytest.mark.parametrize(
    ("reduce", "prefetch"), [("microbatch", 2), ("step", 1)], ids=["microbatch-prefetch2", "step"]
)
def test_zero3_offload_overlaps_as_recorded_and_stays_transparent(reduce, prefetch):
    zero = {"stage": 3, "reduce": reduce, "prefetch": prefetch, **OFFLOAD}
    steps, microbatches = 2, 4
    config = {"microbatches": microbatches, "zero": zero}
    results = run_distributed(recorded_training, 2, args=(config, steps), timeout=180)
    _assert_transparent(results, steps)
    for r in results:
        log = [tuple(record) for record in r["log"]]
        _check_gathers(log, prefetch)
        _check_copy_in_then_gather(log)
        issued = _check_reductions(log)
        _check_copies_out(log, steps)
        per_step = microbatches if reduce == "microbatch" else 1
        assert issued and set(issued.values()) == {per_step * steps}, issued


def test_reduce_once_per_step_is_transparent_under_nccl_rules_at_pp2_dp2():
    zero = {"stage": 2, "reduce": "step"}
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "zero": zero, "nccl_rules": True}
    results = run_distributed(train_ranks, 4, args=(config, "mlp", "adamw", 3, 0.5), timeout=180)
    _assert_transparent(results, 3)


def _check_host_steps(log: list[Record], steps: int) -> None:
    """Each bucket steps right after the host waited for its own gradient (its copy
    on ``copy_out``, or a marker behind a copy on the compute stream), and for no
    other bucket's; the buckets step in reverse order (the backward's), once a step."""
    waited: list[str] = []
    stepped: list[str] = []
    for op, _, label in log:
        if op == "host":
            waited.append(label.partition(":")[2])
        elif op == "mark" and label.startswith("step "):
            bucket = label[len("step ") :]
            assert waited == [bucket], (bucket, waited)
            stepped.append(bucket)
            waited = []
    per_step = len(stepped) // steps
    assert per_step > 1 and len(stepped) == per_step * steps, stepped
    order = stepped[:per_step]
    assert order == sorted(order, key=lambda b: -int(b.rpartition("@")[2])), order
    assert stepped == order * steps, stepped


PP2_DP2 = {"pipeline_parallel_degree": 2, "virtual_stages": 2, "nccl_rules": True}


@pytest.mark.parametrize(
    ("zero", "layout", "world"),
    [
        ({"stage": 3, **OFFLOAD}, {}, 2),
        ({"stage": 2, "offload_optimizer": "cpu"}, {}, 2),
        ({"stage": 3, **OFFLOAD}, PP2_DP2, 4),
    ],
    ids=["zero3-dp2", "zero2-dp2", "zero3-pp2-virtual-dp2-nccl-rules"],
)
def test_the_host_optimizer_steps_each_bucket_once_its_own_gradient_landed(zero, layout, world):
    steps = 2
    config = {"microbatches": 4, "zero": zero, **layout}
    results = run_distributed(recorded_training, world, args=(config, steps, None), timeout=180)
    _assert_transparent(results, steps, clip=None)
    for r in results:
        _check_host_steps([tuple(record) for record in r["log"]], steps)
        assert r["syncs"]["offload copies"] == steps, r["syncs"]
