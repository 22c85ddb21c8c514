"""This process's resident set, sampled on a thread (DESIGN.md's peak during training,
on the CPU), for tests and benchmarks::

    with RssPeak() as rss:
        train_step()
    rss.peak - rss.baseline  # the most bytes resident above those at entry

Linux only (``/proc/self/statm``). Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so large
tensors are mmapped and leave the resident set as soon as they are freed.
"""

from __future__ import annotations

import os
import threading

__all__ = ["RssPeak"]

PAGE = os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Samples every ``interval`` s from entry to exit: ``peak``, the most bytes resident
    since entry (or the last :meth:`reset`), and ``baseline``, the bytes then."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = self.baseline = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        """The bytes resident now."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.now())

    def reset(self) -> int:
        """Start a new peak from now; returns the bytes resident now (the new baseline)."""
        self.peak = self.baseline = self.now()
        return self.baseline

    def __enter__(self) -> RssPeak:
        self.reset()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
