"""The hang watchdog's pure parts: the position record, the diagnosis, the report."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from mpar.comm._consistency import config_differences
from mpar.comm._hang import diagnose, format_report, position
from mpar.comm._progress import PROGRESS, Progress, describe_label, describe_wait, watched
from mpar.comm._snapshot import thread_stacks
from mpar.comm._types import Transfer, TransferLabel
from mpar.comm._watchdog import transport_timeout

NOW = 1000.0


def _snap(rank: int, *, wait: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    snap = {
        "rank": rank,
        "pid": 100 + rank,
        "host": "h",
        "time": NOW,
        "step": 1,
        "in_step": True,
        "action": f"{rank}F0",
        "last": NOW - 1.0,
        "wait": wait,
        "recent": [[NOW - 2.0, 1, "step begins"], [NOW - 1.0, 1, f"{rank}F0"]],
        "stacks": f"Thread MainThread (most recent call last):\n  File 'r{rank}.py'\n",
        "main_stack": f"Thread MainThread:\n  File 'r{rank}.py'\n",
    }
    snap.update(fields)
    return snap


def _recv(src: int, since: float = NOW - 9.0) -> dict[str, Any]:
    text = describe_wait(("recv", src, TransferLabel(Transfer.ACTIVATIONS, 1, 0)))
    return {"kind": "recv", "name": None, "text": text, "peers": [src], "peers_all": [src],
            "since": since}  # fmt: skip


def _barrier(me: int, world: int) -> dict[str, Any]:
    members = list(range(world))
    return {
        "kind": "collective",
        "name": "barrier",
        "text": describe_wait(("collective", "barrier", None), members),
        "peers": [r for r in members if r != me],
        "peers_all": members,
        "since": NOW - 8.0,
    }


def test_progress_keeps_the_last_events_in_order() -> None:
    progress = Progress(capacity=4)
    progress.begin_step()
    for j in range(6):
        progress.begin(f"0F{j}")
    progress.begin_wait(("collective", "barrier", None))
    progress.end_wait()
    progress.end_step()
    events = [(step, kind, what) for _, step, kind, what in progress.recent()]
    assert events == [
        (0, "action", "0F4"),
        (0, "action", "0F5"),
        (0, "collective", ("collective", "barrier", None)),
        (0, "end", None),
    ]
    assert progress.wait is None and not progress.in_step and progress.action == "0F5"
    progress.begin_step()
    assert progress.action is None and progress.step == 1


def test_waits_in_words() -> None:
    assert describe_label(TransferLabel(Transfer.ACTIVATIONS, 1, 3)) == "activations for 1F3"
    assert describe_label(TransferLabel(Transfer.GRADIENTS, 0, 2)) == "gradients for 0B2"
    assert (
        describe_wait(("recv", 0, TransferLabel(Transfer.ACTIVATIONS, 1, 3)))
        == "recv of activations for 1F3 from rank 0"
    )
    assert describe_wait(("collective", "all_reduce", "g"), [0, 2]) == (
        "collective all_reduce over ranks [0, 2]"
    )


def test_the_rank_others_wait_for_is_behind() -> None:
    snaps = {
        0: _snap(0, wait=_recv(1)),
        1: _snap(1, last=NOW - 9.5, action="1F0"),
        2: _snap(2, wait=_recv(1)),
    }
    verdict = diagnose(snaps, 3, {"rank": 0, "wait": snaps[0]["wait"]})
    assert verdict.culprit == 1 and not verdict.deadlock
    assert verdict.message.startswith("rank 1 made no progress for 9.5 s (step 1, action 1F0)")
    assert verdict.message.endswith("ranks 0, 2 wait for it")
    report = format_report(verdict, snaps, 3, 8.0)
    assert report.index("--- rank 1, the one that is behind ---") < report.index("--- rank 0 ---")
    assert "File 'r1.py'" in report  # the culprit's full stack
    assert "waiting 9.0 s for recv of activations for 1F0 from rank 1" in report
    assert "timeout_s=8 s" in report
    assert "If rank 1 is only slow" in report and "raise timeout_s" in report


def test_a_rank_that_does_not_answer_is_behind() -> None:
    snaps = {0: _snap(0, wait=_recv(1))}
    verdict = diagnose(snaps, 2, {"rank": 0, "wait": snaps[0]["wait"]})
    assert verdict.culprit == 1
    assert "did not answer" in verdict.message
    assert "rank 1: did not answer" in format_report(verdict, snaps, 2, 5.0)


def test_an_extra_collective_is_a_deadlock_blamed_on_its_caller() -> None:
    snaps = {0: _snap(0, wait=_barrier(0, 2), in_step=False), 1: _snap(1, wait=_recv(0))}
    verdict = diagnose(snaps, 2, {"rank": 1, "wait": snaps[1]["wait"]})
    assert verdict.deadlock and verdict.culprit == 0
    assert verdict.message.startswith("deadlock: rank 0 waits in barrier, which rank(s) 1")
    assert "rank 1 waits for recv of activations for 1F0 from rank 0" in verdict.message


def test_ranks_in_the_same_collective_do_not_wait_for_each_other() -> None:
    snaps = {
        0: _snap(0, wait=_barrier(0, 3)),
        1: _snap(1, wait=_barrier(1, 3)),
        2: _snap(2, in_step=False, step=4, inside="torch.distributed.all_reduce"),
    }
    verdict = diagnose(snaps, 3, {"rank": 0, "wait": snaps[0]["wait"]})
    assert verdict.culprit == 2 and not verdict.deadlock
    assert "between steps, after step 4, inside torch.distributed.all_reduce" in verdict.message


def test_a_wait_that_ended_while_asking_still_names_the_peer() -> None:
    trigger_wait = _recv(1)
    snaps = {0: _snap(0), 1: _snap(1)}
    verdict = diagnose(snaps, 2, {"rank": 0, "wait": trigger_wait})
    assert verdict.culprit == 1


def test_positions() -> None:
    assert position(_snap(0, step=-1, in_step=False, action=None), brief=True) == (
        "before its first step"
    )
    assert position(_snap(0)) == "step 1, action 0F0; last progress 1.0 s ago"
    assert position(_snap(0, action=None), brief=True) == (
        "step 1, before its first action (partitioning, or the step function)"
    )


def test_stacks_show_a_sleeping_thread() -> None:
    started = threading.Event()

    def sleeper() -> None:
        started.set()
        time.sleep(1.0)

    thread = threading.Thread(target=sleeper, name="sleeper", daemon=True)
    thread.start()
    started.wait()
    every, main = thread_stacks()
    assert "Thread sleeper" in every and "time.sleep(1.0)" in every
    assert main.startswith("Thread MainThread") and "test_stacks_show" in main


@pytest.mark.parametrize("timeout_s", [0.5, 300.0])
def test_transports_wait_longer_than_the_watchdog(timeout_s: float) -> None:
    assert transport_timeout(timeout_s).total_seconds() >= timeout_s + 30


def test_config_differences_name_rank_key_and_both_values() -> None:
    same = {"microbatches": 2, "zero.stage": 1}
    assert config_differences([same, dict(same), dict(same)]) == []
    found = config_differences([same, same, {"microbatches": 4, "zero.stage": 1}])
    assert found == ["rank 2 has microbatches=4 where rank 0 has 2"]


def test_large_jobs_show_every_position_but_few_stacks() -> None:
    snaps = {r: _snap(r, wait=_recv(7)) for r in range(12) if r != 7}
    snaps[7] = _snap(7, last=NOW - 30.0)
    verdict = diagnose(snaps, 12, {"rank": 0, "wait": snaps[0]["wait"]})
    report = format_report(verdict, snaps, 12, 8.0)
    assert verdict.culprit == 7
    assert all(f"rank {r} (pid {100 + r} on h)" in report for r in range(12))
    assert report.count("main thread:") == 4 and "File 'r7.py'" in report


def test_waiting_on_a_collective_handle_shows_in_the_position() -> None:
    seen = []

    class Work:
        def wait(self) -> bool:
            seen.append(PROGRESS.wait)
            return True

        def is_completed(self) -> bool:
            return False

    handle = watched(Work(), "all_reduce", None)
    assert watched(None, "all_reduce", None) is None
    assert handle.wait() is True and not handle.is_completed()
    assert seen == [("collective", "all_reduce", None)] and PROGRESS.wait is None


def test_in_a_cycle_of_transfers_the_longest_waiting_rank_is_named() -> None:
    snaps = {
        0: _snap(0, wait=_recv(1, since=NOW - 5.0)),
        1: _snap(1, wait=_recv(0, since=NOW - 9.0)),
    }
    verdict = diagnose(snaps, 2, {"rank": 0, "wait": snaps[0]["wait"]})
    assert verdict.deadlock and verdict.culprit == 1
    assert verdict.message.startswith("deadlock: rank 1 waits for recv of activations")
