"""The ``@mpar.step`` decorator."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, overload

import torch

from mpar import _device
from mpar._targets import count_targets, is_causal_lm
from mpar.comm import State, is_initialized, state
from mpar.comm._abort import failure_published, publish_failure
from mpar.comm._collectives import all_reduce_group
from mpar.comm._progress import PROGRESS
from mpar.comm._snapshot import write_trace
from mpar.comm._watchdog import exit_if_reported
from mpar.errors import StepError
from mpar.runtime._batch_check import check_same_batch, due_fingerprint
from mpar.runtime._microbatch import Microbatches, split_microbatches
from mpar.runtime._model import DistributedModel, StepFunction
from mpar.runtime._output import StepOutput
from mpar.runtime._timeline import TraceLayout, write_timeline
from mpar.schedule import Schedule

__all__ = ["step"]

F = TypeVar("F", bound=StepFunction)


def _prepare(
    fn: StepFunction,
    model: object,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    non_split_inputs: Sequence[str],
    input_split_axes: Mapping[str, int] | None,
) -> Microbatches:
    """Check the call and split it into microbatches (the same on every rank)."""
    if not isinstance(model, DistributedModel):
        raise TypeError(
            f"the first argument of @mpar.step function {fn.__name__!r} must be the "
            f"mpar.DistributedModel, got {type(model).__name__}"
        )
    if model.active_run is not None:
        raise StepError("a @mpar.step function cannot be called from inside another step")
    if model.config.auto_keys:
        from mpar.runtime._resolve_auto import resolve_auto

        model.config = resolve_auto(
            fn, model, args, kwargs, model.run_state,
            non_split_inputs=non_split_inputs, input_split_axes=input_split_axes,
        )  # fmt: skip
    st = model.run_state
    _device.reset_peak(st.device)  # memory_report's device_peak: since this step began
    batches = split_microbatches(
        fn,
        (model, *args),
        kwargs,
        st.config.microbatches,
        non_split_inputs=non_split_inputs,
        input_split_axes=input_split_axes,
    )
    return Microbatches(
        _device.to_device(batches.args, st.device),
        _device.to_device(batches.kwargs, st.device),
        batches.sizes,
    )


def _count_targets(
    fn: StepFunction, model: DistributedModel, batches: Microbatches
) -> Microbatches:
    """Where the batch holds integer ``labels``: each microbatch's kept targets and, in
    a training step, every replica's (one all-reduce over the data-parallel group, on
    the device); see ``mpar._targets``."""
    names = list(inspect.signature(fn).parameters)[1:]
    counts = count_targets(is_causal_lm(model.module), batches.args, batches.kwargs, names)
    if counts is None:
        return batches
    total = None
    if torch.is_grad_enabled():
        total = counts.sum(0)
        if model.grid.dp_size > 1:
            all_reduce_group(total, model.grid.dp_group)
        total = total.clamp(min=1)  # no target anywhere: every loss is weighed 0
    return dataclasses.replace(batches, targets=counts, total_targets=total)


def _shard_sequences(
    fn: StepFunction, model: DistributedModel, batches: Microbatches
) -> Microbatches:
    """Under context parallelism, this CP rank's share of every microbatch's sequences
    (``mpar.context_parallel``); the batches unchanged otherwise."""
    grid = model.grid
    if grid.cp_size == 1:
        return batches
    from mpar.context_parallel import shard_batches

    names = list(inspect.signature(fn).parameters)[1:]
    args, kwargs, contexts = shard_batches(
        batches.args, batches.kwargs, names, grid.cp_size, grid.cp_rank
    )
    return dataclasses.replace(batches, args=args, kwargs=kwargs, contexts=contexts)


def _execute(fn: StepFunction, model: DistributedModel, batches: Microbatches) -> StepOutput:
    """Partition if needed and run this rank's schedule; a failure stops every rank."""
    st = model.run_state
    PROGRESS.begin_step()
    try:
        with _device.sync_debug():
            run = model.run_step(fn, batches)
    except BaseException:
        exit_if_reported()
        PROGRESS.end_step(ok=False)
        publish_failure(st.layout.rank, traceback.format_exc())
        write_trace(st.config.trace, st.layout.rank)
        raise
    PROGRESS.end_step()
    if run.timeline is not None and st.config.trace:
        run.timeline.end = time.time()
        write_timeline(
            st.config.trace, PROGRESS.step, run.timeline, _trace_layout(st, run.schedule)
        )
    assert run.outputs is not None  # a run that returned has them
    return run.outputs


def _refuse_after_a_failure() -> None:
    """A rank whose step failed has told its peers, which are stopping: a step it ran
    now would send them transfers of another step (gloo aborts the receiver with
    "Received data size doesn't match expected size", hiding the first error) or let
    the job go on with its watchers gone. One rank alone has no peers to upset."""
    failure = failure_published()
    if failure is not None and is_initialized() and state().layout.world_size > 1:
        raise StepError(
            f"a step failed on this rank ({failure}), and every rank of the job was told "
            "to stop: no further step can run. Let that exception end the process, or fix "
            "its cause; catching an exception from a step and continuing works only in a "
            "job of one rank"
        )


def _trace_layout(st: State, schedule: Schedule) -> TraceLayout:
    """What ``mpar schedule --trace`` needs to rebuild and simulate the schedule."""
    cfg = st.config
    return {
        "rank": st.layout.rank,
        "pp_rank": st.grid.pp_rank,
        "dp_rank": st.grid.dp_rank,
        "pipeline": cfg.pipeline,
        "num_ranks": cfg.pipeline_parallel_degree,
        "virtual_stages": cfg.virtual_stages,
        "microbatches": schedule.num_microbatches,
        "active_microbatches": cfg.active_microbatches,
        "forward_only": schedule.is_forward_only,
        "schedule": schedule.to_dict(),  # the lowered schedule the ranks executed
    }


@overload
def step(fn: F) -> Callable[..., StepOutput]: ...


@overload
def step(
    fn: None = None,
    *,
    non_split_inputs: Sequence[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
) -> Callable[[F], Callable[..., StepOutput]]: ...


def step(
    fn: StepFunction | None = None,
    *,
    non_split_inputs: Sequence[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
) -> Callable[..., StepOutput] | Callable[[F], Callable[..., StepOutput]]:
    """Decorate a training or evaluation step that runs once per microbatch.

    The function's first argument is the :class:`DistributedModel`; every
    tensor in the other arguments (also nested in lists, tuples and dicts) is
    split into ``microbatches`` pieces along axis 0, or the axis given in
    ``input_split_axes={"name": axis}``; arguments named in
    ``non_split_inputs`` go whole to every microbatch. Inside, call
    ``model(...)`` once and ``model.backward(loss)`` (with a loss averaged over
    the microbatch) to train; without ``model.backward`` the step is
    forward-only. Gradients accumulated over the microbatches equal those of
    the whole batch. Returns a :class:`StepOutput`, the same on every rank.

    Under context parallelism (``context_parallel_degree`` > 1) each microbatch's
    sequences (axis 1) are then cut among the CP group's ranks, which were given the
    same batch; see ``docs/context_parallel.md`` for what is cut and read by name
    (``input_ids``, ``position_ids``, ``attention_mask``, ``labels``).
    """
    if fn is None:
        return functools.partial(
            step, non_split_inputs=tuple(non_split_inputs), input_split_axes=input_split_axes
        )
    if not callable(fn):
        raise TypeError(f"@mpar.step decorates a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(model: DistributedModel, *args: object, **kwargs: object) -> StepOutput:
        _refuse_after_a_failure()
        batches = _prepare(fn, model, args, kwargs, non_split_inputs, input_split_axes)
        prints = due_fingerprint(model.grid, model.due_batch_check, batches.args, batches.kwargs)
        batches = _count_targets(fn, model, batches)  # before CP cuts the labels
        batches = _shard_sequences(fn, model, batches)  # after the check: CP ranks agree
        outputs = _execute(fn, model, batches)
        check_same_batch(model.grid, prints)
        return outputs

    return wrapper
