"""``mpar.shutdown`` resets every piece of process state listed in
``mpar.comm._process_state``, after a pipeline step that touched them, and ``mpar.init``
then runs again and trains as the first run did."""

from __future__ import annotations

import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import batch, make_optimizer, start_training


def _run(config, root):
    """One run: a step and an asynchronous checkpoint; what each piece holds meanwhile,
    and its loss."""
    import mpar
    from mpar.comm import _process_state

    model, opt, train = start_training(config, lambda params: make_optimizer("sgd", params))
    x, y = batch("mlp", 0)
    loss = train(model, x, y).reduce_mean()
    opt.step()
    opt.zero_grad()
    handle = mpar.save_checkpoint(root, model, opt, async_save=True)
    during = {p.name: p.is_reset() for p in _process_state.pieces()}
    mpar.shutdown()
    assert handle.done()  # shutdown finished the pending save
    return during, loss


def _twice(root):
    import mpar
    from mpar.comm import _process_state

    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "trace": f"{root}/trace"}
    during, first = _run(config, f"{root}/a")
    after = {p.name: p.is_reset() for p in _process_state.pieces()}
    again, second = _run(config, f"{root}/b")
    after_again = {p.name: p.is_reset() for p in _process_state.pieces()}
    return {
        "names": [p.name for p in _process_state.pieces()],
        "during": during,
        "after": after,
        "again": again,
        "after_again": after_again,
        "losses": (first, second),
        "initialized": mpar.is_initialized(),
    }


def test_shutdown_resets_every_piece_of_process_state_and_init_runs_again(tmp_path):
    for rank, out in enumerate(run_distributed(_twice, 2, args=(str(tmp_path),), timeout=180)):
        names = out["names"]
        assert len(names) == len(set(names)) >= 11
        assert all(out["after"].values()), [n for n, ok in out["after"].items() if not ok]
        assert all(out["after_again"].values())
        assert not out["initialized"]
        # the run had changed them: the session, the threads of a 2-rank job, the
        # flight recorder, the TP groups, the exit hooks, the timeline, the saved-bytes
        # counts, the checkpoint thread
        for during in (out["during"], out["again"]):
            changed = {n for n, ok in during.items() if not ok}
            assert changed >= {
                "mpar.comm._lifecycle._SESSION",
                "mpar.comm._abort",
                "mpar.comm._watchdog",
                "mpar.comm._progress.PROGRESS",
                "mpar.comm._tp_ops._GROUPS",
                "mpar.comm._lifecycle._EXIT_HOOKED",
                "mpar.runtime._timeline._STEPS",
                "mpar.checkpoint._async",
            }, (rank, changed)
            if rank == 0:  # the first stage keeps its inputs' saved bytes
                assert "mpar.runtime._activations._SAVED_BYTES" in changed
        first, second = out["losses"]
        torch.testing.assert_close(first, second, rtol=0, atol=0)
