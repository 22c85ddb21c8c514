"""Shared pytest settings: mpar is imported from this checkout."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Keep torch in the test process itself to one thread: ranks share 2 cores.
os.environ.setdefault("MPAR_TEST", "1")
