"""This process's resident set sampled every 2 ms on a thread (DESIGN.md's peak during
training, on the CPU): ``with RssPeak() as rss: ...`` then ``rss.peak``, the most
bytes resident from entry to exit, and ``rss.baseline``, the bytes at entry."""

from __future__ import annotations

import os
import threading

__all__ = ["RssPeak"]


class RssPeak:
    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.baseline = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RssPeak:
        self.peak = self.baseline = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
