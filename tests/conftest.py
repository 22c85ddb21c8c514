"""Shared pytest settings: mpar is imported from this checkout."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Keep torch in the test process itself to one thread: ranks share 2 cores.
os.environ.setdefault("MPAR_TEST", "1")

try:  # reproducible property tests in CI (CI=true): the same examples every run
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None)
    if os.environ.get("CI"):
        settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass
