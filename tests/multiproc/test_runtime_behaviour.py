"""Runtime behaviour beyond transparency: errors, eval steps, state dicts, failures."""

from __future__ import annotations

import time

import pytest
import torch

from mpar.testing import DistributedTestError, run_distributed
from tests.multiproc._pipeline_cases import (
    batch,
    loss_fn,
    make_optimizer,
    mlp,
    tiny_gpt,
    train_loss,
)


def _errors_single_rank():
    import mpar
    from mpar.errors import NotInitializedError, StepError

    found = {}
    try:
        mpar.DistributedModel(mlp())
    except NotInitializedError as exc:
        found["before_init"] = str(exc)
    mpar.init({"microbatches": 4})
    model = mpar.DistributedModel(mlp())
    x, y = batch("mlp", 0)
    for name, call in [
        ("call_outside", lambda: model(x)),
        ("backward_outside", lambda: model.backward(torch.zeros(()))),
    ]:
        try:
            call()
        except StepError as exc:
            found[name] = str(exc)

    try:
        train_loss(model, x[:3], y[:3])
    except StepError as exc:
        found["small_batch"] = str(exc)
    try:
        train_loss(model, x, y[:5])
    except StepError as exc:
        found["mismatched"] = str(exc)

    @mpar.step
    def returns_object(m, x):
        m(x)
        return object()

    try:
        returns_object(model, x)
    except StepError as exc:  # cannot be gathered to every rank
        found["ungatherable"] = str(exc)

    @mpar.step
    def never_calls(m, x):
        return x.sum()

    try:
        never_calls(model, x)
    except StepError as exc:
        found["never_calls"] = str(exc)
    try:
        train_loss(mlp(), x, y)
    except TypeError as exc:
        found["not_distributed"] = str(exc)
    return found


def test_clear_errors():
    (found,) = run_distributed(_errors_single_rank, 1, timeout=60)
    assert "call mpar.init" in found["before_init"]
    assert "@mpar.step" in found["call_outside"]
    assert "@mpar.step" in found["backward_outside"]
    assert "smaller than microbatches=4" in found["small_batch"]
    assert "different batch sizes" in found["mismatched"]
    assert (
        "never called the model" in found["never_calls"]
        or "without calling" in found["never_calls"]
    )
    assert "mpar.DistributedModel" in found["not_distributed"]
    assert "is a object, which mpar cannot gather" in found["ungatherable"]


def _eval_and_state(config):
    import mpar

    mpar.init(config)
    net = mlp()
    reference = mlp()
    model = mpar.DistributedModel(net)
    opt = mpar.DistributedOptimizer(make_optimizer("adamw", model.parameters()))

    @mpar.step
    def evaluate(m, x, y):
        out = m(x)
        return {"loss": loss_fn(out, y), "out": out}

    x, y = batch("mlp", 0)
    train_loss(model, x, y)
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        ev = evaluate(model, x, y)
    no_grad_params = all(p.grad is None for p in model.parameters())
    forward_only = evaluate(model, x, y)  # grad enabled but no backward: nothing accumulates
    model.train()
    full = model.state_dict()
    reference.load_state_dict(full)  # loads into the unwrapped model
    opt_state = opt.state_dict()
    plain = make_optimizer("adamw", reference.parameters())
    plain.load_state_dict(opt_state)  # and the gathered optimizer state into a plain one
    opt.load_state_dict(opt_state)
    return {
        "eval_out": ev["out"].concat(),
        "eval_loss": float(ev["loss"].reduce_mean()),
        "fwd_only_loss": float(forward_only["loss"].reduce_mean()),
        "no_grads": no_grad_params and all(p.grad is None for p in model.parameters()),
        "ref_out": reference(x).detach(),
        "opt_state_keys": sorted(opt_state["state"]),
        "n_params": len(list(reference.parameters())),
    }


@pytest.mark.parametrize("config", [{"pipeline_parallel_degree": 2, "microbatches": 4}])
def test_eval_steps_and_full_state_dicts(config):
    results = run_distributed(_eval_and_state, 2, args=(config,), timeout=90)
    for r in results:
        torch.testing.assert_close(r["eval_out"], r["ref_out"], rtol=1e-5, atol=1e-6)
        assert r["no_grads"]
        assert r["eval_loss"] == pytest.approx(r["fwd_only_loss"], rel=1e-6)
        assert r["opt_state_keys"] == list(range(r["n_params"]))
    torch.testing.assert_close(results[0]["eval_out"], results[1]["eval_out"])


def _fail_inside_step(bad_rank):
    import mpar

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 120})
    model = mpar.DistributedModel(mlp())

    @mpar.step
    def train(m, x, y):
        out = m(x)
        if mpar.rank() == bad_rank:
            raise RuntimeError(f"deliberate failure inside the step on rank {bad_rank}")
        loss = loss_fn(out, y)
        m.backward(loss)
        return loss

    x, y = batch("mlp", 0)
    train(model, x, y)


def test_exception_on_one_rank_stops_every_rank_quickly():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_inside_step, 4, args=(3,), timeout=60)
    elapsed = time.monotonic() - started
    assert "deliberate failure inside the step on rank 3" in str(info.value)
    assert elapsed < 30, f"took {elapsed:.1f} s: ranks waited for the collective timeout"


def _catch_and_step_again(path):
    """Rank 0's first stage fails in step 1 (a float64 batch); it catches the exception
    and tries step 2 at once, writing what happened to ``path``."""
    import mpar
    from mpar.errors import StepError

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    model = mpar.DistributedModel(mlp())

    x, y = batch("mlp", 0)
    train_loss(model, x, y)
    try:
        train_loss(model, x.double() if mpar.rank() == 0 else x, y)
    except RuntimeError:
        try:
            train_loss(model, x, y)
            outcome = "ran"
        except StepError as exc:
            outcome = str(exc)
        with open(path, "w") as f:
            f.write(outcome)
        raise  # (a rank 0 that ended quietly would take the store, and the news, with it)


def test_a_rank_that_catches_its_failed_step_cannot_run_another(tmp_path):
    """Before, rank 0 ran step 2 while rank 1 still waited in step 1: rank 1 took step 2's
    messages for step 1's (gloo aborts it under NCCL's rules: "Received data size doesn't
    match expected size"), or both ranks went on training with their watchers gone."""
    path = tmp_path / "outcome"
    with pytest.raises(DistributedTestError, match="mat1 and mat2"):
        run_distributed(_catch_and_step_again, 2, args=(str(path),), timeout=60)
    outcome = path.read_text()
    assert outcome.startswith("a step failed on this rank (RuntimeError: mat1 and mat2"), outcome
    assert "no further step can run" in outcome


def _saved_bytes(checkpointing):
    import mpar
    from tests.multiproc._pipeline_cases import tiny_gpt

    mpar.init({"microbatches": 2, "activation_checkpointing": checkpointing})
    model = mpar.DistributedModel(tiny_gpt())

    x, y = batch("gpt", 0)
    train_loss(model, x, y)  # partition first
    packed = []

    def pack(t):
        packed.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        train_loss(model, x, y)
    return sum(packed), mpar.memory_report()["cpu"]["activations"]


def test_activation_checkpointing_keeps_far_fewer_activations():
    """Counted by a user's saved-tensor hook around the step (mpar's own counting
    inside the stages passes it every tensor) and by ``memory_report()``."""
    ((without, reported_without),) = run_distributed(_saved_bytes, 1, args=(False,), timeout=60)
    ((with_ckpt, reported_with),) = run_distributed(_saved_bytes, 1, args=(True,), timeout=60)
    assert with_ckpt < without / 5, (with_ckpt, without)
    assert reported_with < reported_without / 5, (reported_with, reported_without)
    assert reported_without > 0


def _activations_over_steps():
    import mpar
    from mpar.runtime import _activations
    from tests.multiproc._pipeline_cases import tiny_gpt

    mpar.init({"microbatches": 2})
    model = mpar.DistributedModel(tiny_gpt())

    x, y = batch("gpt", 0)
    counted = []
    original = _activations._SavedBytes

    class Counting(original):
        def __init__(self, *args):
            counted.append(1)
            super().__init__(*args)

    _activations._SavedBytes = Counting
    try:
        reports = []
        for xs, ys in ((x, y), (x, y), (x[:-2], y[:-2])):  # the last: smaller microbatches
            train_loss(model, xs, ys)
            reports.append((mpar.memory_report()["cpu"]["activations"], len(counted)))
    finally:
        _activations._SavedBytes = original
    return reports


def test_saved_activations_are_counted_once_per_input_shape():
    """Saved-tensor hooks are slow on the CPU: each stage counts what autograd saves on
    its first forward of each input shape and reuses the count after."""
    ((first, again, smaller),) = run_distributed(_activations_over_steps, 1, timeout=60)
    assert first[0] > 0 and first[1] == 1  # one stage, one shape: counted once
    assert again == first  # same shapes: same figure, nothing counted again
    assert smaller[1] == 2 and 0 < smaller[0] < first[0]  # a new shape is counted anew


def _two_models(config):
    import copy

    import mpar
    from tests.multiproc._pipeline_cases import BATCH

    mpar.init(config)
    torch.manual_seed(0)
    nets = [mlp(), mlp()]
    refs = [copy.deepcopy(n) for n in nets]
    models = [mpar.DistributedModel(n) for n in nets]
    found = {}
    try:  # parameters of both models: which one it updates is not guessed
        mpar.DistributedOptimizer(torch.optim.SGD([*nets[0].parameters(), *nets[1].parameters()]))
    except ValueError as exc:
        found["ambiguous"] = str(exc)
    opt_a = mpar.DistributedOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1))
    opt_b = mpar.DistributedOptimizer(
        torch.optim.SGD(nets[1].parameters(), lr=0.05), model=models[1]
    )
    found["tied"] = (opt_a.model is models[0], opt_b.model is models[1])

    x, y = batch("mlp", 0)
    rows = slice(
        mpar.dp_rank() * BATCH // mpar.dp_size(), (mpar.dp_rank() + 1) * BATCH // mpar.dp_size()
    )
    for model, opt in ((models[0], opt_a), (models[1], opt_b)):
        train_loss(model, x[rows], y[rows])
        opt.step()
        opt.zero_grad()
    for ref, lr in zip(refs, (0.1, 0.05)):  # one process, whole batch
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    found["got"] = [m.state_dict() for m in models]
    found["want"] = [r.state_dict() for r in refs]
    return found


@pytest.mark.parametrize(
    "config",
    [{"microbatches": 2, "zero": {"stage": 1}}, {"pipeline_parallel_degree": 2, "microbatches": 2}],
)
def test_each_optimizer_updates_its_own_model(config):
    """Two models, each with its optimizer (found by its parameters, or given as
    ``model=``): each optimizer updates its own model, as in one process."""
    for found in run_distributed(_two_models, 2, args=(config,), timeout=120):
        assert "belong to 2 DistributedModels" in found["ambiguous"]
        assert "model=model" in found["ambiguous"]
        assert found["tied"] == (True, True)
        for got, want in zip(found["got"], found["want"]):
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def _caches_across_shutdown(trace_dir):
    import mpar
    from mpar.comm._progress import PROGRESS
    from mpar.runtime import _activations, _timeline
    from tests.multiproc._pipeline_cases import start_training

    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "trace": trace_dir}
    seen = []
    for _ in range(2):  # init, step, shutdown; again: the grid and caches start afresh
        model, _, train = start_training(config, lambda p: torch.optim.SGD(p, lr=0.1))
        loss = train(model, *batch("mlp", 0)).reduce_mean().item()
        during = (len(_timeline._STEPS), len(_activations._SAVED_BYTES), PROGRESS.step)
        mesh = mpar.comm.state().grid.mesh
        mesh_dims = None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.shape))
        mpar.shutdown()  # the model is still alive: its saved-bytes counts would be too
        after = (len(_timeline._STEPS), len(_activations._SAVED_BYTES), PROGRESS.step)
        seen.append({"loss": loss, "during": during, "after": after, "mesh": mesh_dims})
        del model
    return seen


def test_shutdown_resets_the_caches_and_init_starts_afresh(tmp_path):
    for seen in run_distributed(_caches_across_shutdown, 2, args=(str(tmp_path),), timeout=120):
        first, second = seen
        assert first["during"][0] == 1 and first["during"][1] >= 1 and first["during"][2] == 0
        assert first["after"] == second["after"] == (0, 0, -1)  # -1: no step started
        assert second["during"] == first["during"]  # nothing left over from the first init
        assert first["loss"] == second["loss"]
        assert first["mesh"] == (("pp", "dp", "cp", "tp"), (2, 1, 1, 1))


_HEAD = 512  # a wide last layer: what its W keeps (its output gradient) dwarfs what it saves


def _wide_head() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 32), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, _HEAD))


def _activations_of(
    pipeline: str,
    split_backward: bool,
    active: int | None = None,
    memory_weight: float | None = None,
) -> dict[str, object]:
    import mpar

    mpar.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 4,
            "pipeline": pipeline,
            "split_backward": split_backward,
            "active_microbatches": active,
            "memory_weight": memory_weight,
        }
    )
    model = mpar.DistributedModel(_wide_head())

    @mpar.step
    def train(m, x, y):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        m.backward(loss)
        return loss

    torch.manual_seed(1)
    x, y = torch.randn(48, 8), torch.randint(_HEAD, (48,))
    train(model, x, y)
    mine = model.plan.stages[mpar.pp_rank()]
    weights = [p for p in model.local_parameters() if p.dim() == 2]  # (out, in) of each Linear
    return {
        "rank": mpar.pp_rank(),
        "measured": mpar.memory_report()["cpu"]["activations"],
        "planned": mine.activation_bytes,
        "in_flight": mine.in_flight,
        "extra": mine.extra_bytes,  # kept boundary tensors, message buffers, the loss
        "units": mine.units,
        # what a W of one microbatch (12 rows) keeps on this rank: inputs, output grads
        "weight_work": sum(12 * 4 * sum(w.shape) for w in weights),
    }


def test_a_split_backward_counts_what_each_waiting_w_keeps():
    """zero_bubble's last stage holds one microbatch in flight and one whose W waits
    (its linear layers' inputs and output gradients), where 1F1B holds one: the
    runtime's activation peak counts the difference, and the plan (which counts each
    microbatch in flight as the larger of the two) is not below it.
    Without the split (``split_backward: false``) zero_bubble holds what 1F1B holds.
    The three runs split by memory alone (``memory_weight: 1``): a split by measured
    timings moves a Tanh across the boundary from run to run (it costs next to nothing)."""
    runs = {
        name: {r["rank"]: r for r in run_distributed(_activations_of, 2, args=args, timeout=90)}
        for name, args in {
            "1f1b": ("interleaved", True, None, 1.0),
            "zb": ("zero_bubble", True, None, 1.0),
            "zb_unsplit": ("zero_bubble", False, None, 1.0),
        }.items()
    }
    last = {name: ranks[1] for name, ranks in runs.items()}
    assert len({tuple(r["units"]) for r in last.values()}) == 1, "three runs split differently"
    one = last["1f1b"]["measured"]  # 1F1B's last stage: one microbatch at a time
    kept = last["zb"]["weight_work"]
    assert kept > one > 0
    # ZB-H1's last stage at p=2, m=4 (F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3) peaks at one
    # microbatch in flight beside a waiting W, or at the two Ws waiting at the end
    expected = max(one + kept, 2 * kept)
    assert abs(last["zb"]["measured"] - expected) <= 0.1 * kept, (last["zb"], one, kept)
    # nothing waits for a W: what 1F1B holds (give or take the boundary's bytes)
    assert abs(last["zb_unsplit"]["measured"] - one) <= 0.1 * kept, (last["zb_unsplit"], one)
    # the plan's activations are not below what ran, and close to it for zero_bubble
    # (the plan counts the stage's received input in extra_bytes, the runtime among its
    # activations when the first unit saves it)
    for name in ("1f1b", "zb", "zb_unsplit"):
        planned = last[name]["planned"] + last[name]["extra"]
        assert planned >= last[name]["measured"], (name, last[name])
    assert last["zb"]["planned"] <= 1.25 * last["zb"]["measured"], last["zb"]


@pytest.mark.parametrize(("pipeline", "cap"), [("simple", 2), ("interleaved", 1)])
def test_a_cap_on_microbatches_in_flight_holds_and_plans_fewer(pipeline, cap):
    """``active_microbatches`` below the schedule's peak: the first stage holds ``cap``
    microbatches instead of its peak (GPipe: all 4; 1F1B: 2), and the plan counts what
    the capped schedule holds: it drops in the proportion the runtime's peak drops, is not
    below what ran on either stage, and is within 25 % of it on the first. Both runs split
    by memory alone (``memory_weight: 1``), so they split alike: a split by timings could
    differ between them."""
    # the split by memory alone (bytes, not timings): the same in both runs
    runs = {
        k: {r["rank"]: r for r in run_distributed(_activations_of, 2, args=args, timeout=90)}
        for k, args in {None: (pipeline, True, None, 1.0), cap: (pipeline, True, cap, 1.0)}.items()
    }
    free, capped = runs[None][0], runs[cap][0]  # the first stage: the most in flight
    assert capped["in_flight"] == cap < free["in_flight"]
    assert capped["measured"] < free["measured"], (capped, free)
    # the plan drops in the proportion the runtime's peak drops (the microbatches no
    # longer held)
    planned, measured = (capped[k] / free[k] for k in ("planned", "measured"))
    assert planned == pytest.approx(measured, rel=0.1), (capped, free)
    for run in runs.values():
        # per-unit profiles count a tensor two units save (one's output, the next one's
        # input) twice: the plan is conservative by that much
        assert run[0]["measured"] <= run[0]["planned"] <= 1.25 * run[0]["measured"], run[0]
        # the last stage: its received input (a view of its message) the plan counts in
        # extra_bytes with the pipeline messages (beside the loss), unless its first unit
        # saves it
        assert run[1]["measured"] <= run[1]["planned"] + run[1]["extra"], run[1]


def _accumulate_over_steps(config):
    """Two step calls per optimizer step, no ``zero_grad`` between them (gradient
    accumulation over step calls); this replica's shard of each batch."""
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    dp, rank = mpar.dp_size(), mpar.dp_rank()
    size = len(batch("mlp", 0)[0])
    shard = slice(rank * size // dp, (rank + 1) * size // dp)
    losses, grads = [], []
    for s in range(4):
        x, y = batch("mlp", s)
        losses.append(float(train_loss(model, x[shard], y[shard]).reduce_mean()))
        if s % 2:
            # ZeRO >= 1 keeps reduced gradients in shards, not in .grad
            grads.append(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "grads": grads, "state": model.state_dict()}


@pytest.mark.parametrize(
    "config",
    [
        {"microbatches": 2},  # ZeRO-0 over dp 2: the earlier step's all-reduced sum kept apart
        pytest.param(
            {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 1}},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["dp2-zero0", "pp2-dp2-zero1", "pp2-dp2-zero3"],
)
def test_gradients_accumulate_over_step_calls_before_one_optimizer_step(config):
    """As ``loss.backward()`` twice in one process: the second step's gradients add to the
    first's. At ZeRO-0 with data parallelism the second step used to raise a RuntimeError
    (its backward accumulated into the already all-reduced buffer)."""
    world = 2 * config.get("pipeline_parallel_degree", 1)
    results = run_distributed(_accumulate_over_steps, world, args=(config,), timeout=120)
    net = mlp()
    opt = make_optimizer("sgd", net.parameters())
    losses, grads = [], []
    for s in range(4):
        x, y = batch("mlp", s)
        loss = loss_fn(net(x), y)
        loss.backward()
        losses.append(loss.item())
        if s % 2:
            grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
            opt.step()
            opt.zero_grad()
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), **tol)
        for got, want in zip(r["grads"], grads, strict=True):
            for name, grad in got.items():  # this rank's parameters
                torch.testing.assert_close(grad, want[name], **tol, msg=name)
        for name, value in net.state_dict().items():
            torch.testing.assert_close(r["state"][name], value, **tol, msg=name)


def _call_the_module_itself():
    """A training step at pp 2, then the partitioned module called outside a step."""
    import mpar
    from mpar.errors import StepError

    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = mpar.DistributedModel(mlp())
    x, y = batch("mlp", 0)
    train_loss(model, x, y)
    try:
        with torch.no_grad():
            model.module(x)
    except StepError as exc:
        return str(exc)
    return "ran"


def test_calling_the_partitioned_module_itself_says_what_to_do():
    """Hugging Face's ``generate`` (or a plain evaluation forward) on ``model.module``
    after partitioning used to fail inside torch ("mat2 must be a matrix, got 1-D
    tensor"): this rank released the other stage's parameters."""
    for message in run_distributed(_call_the_module_itself, 2, timeout=60):
        assert "called outside a step, but this rank released" in message, message
        assert "Inference and generation" in message


def _greedy(config, prompt, new_tokens):
    """Greedy generation through the DistributedModel: a forward-only step per token,
    the sequence axis dynamic."""
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(tiny_gpt(), dynamic_axes=(0, 1))

    @mpar.step
    def next_token(m, ids):
        return m(ids)[:, -1].argmax(-1)

    model.eval()
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, next_token(model, ids).concat()[:, None]], dim=1)
    return ids


def test_greedy_generation_through_a_step_equals_the_unwrapped_model():
    """The inference recipe of docs/runtime.md gives the unwrapped model's greedy tokens
    at pp 2."""
    prompt = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(3))
    net = tiny_gpt().eval()
    ids = prompt
    with torch.no_grad():
        for _ in range(3):
            ids = torch.cat([ids, net(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    config = {"pipeline_parallel_degree": 2, "microbatches": 2}
    for got in run_distributed(_greedy, 2, args=(config, prompt, 3), timeout=120):
        assert torch.equal(got, ids)


def _fp16_step_after_step_without_zero_grad():
    import mpar
    from mpar.errors import StepError

    mpar.init({"microbatches": 2, "fp16": True})
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    x, y = batch("mlp", 0)
    train_loss(model, x, y)
    train_loss(model, x, y)  # accumulating over step calls before optimizer.step() is fine
    opt.step()
    found = {}
    for name, call in [("step", lambda: train_loss(model, x, y)), ("again", opt.step)]:
        try:
            call()
        except StepError as exc:
            found[name] = str(exc)
    opt.zero_grad()
    train_loss(model, x, y)  # cleared: trains and steps again
    opt.step()
    return found


def test_fp16_refuses_reusing_gradients_an_optimizer_step_already_read():
    """fp16 without zero_grad after optimizer.step(): the kept gradients are unscaled, the
    next step's loss-scaled, and their sum used to reach the next update (by torch's
    GradScaler arithmetic with fp32 gradients, as a plain sum with fp16 ones)."""
    (found,) = run_distributed(_fp16_step_after_step_without_zero_grad, 1, timeout=60)
    assert "training step after optimizer.step() without" in found.get("step", ""), found
    # and a second optimizer.step() used to apply the gradients divided by the loss scale
    # again (fp32 gradients, 1/65536 of the first update) or as they were (fp16 ones)
    assert "optimizer.step() again without" in found.get("again", ""), found
