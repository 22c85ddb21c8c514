"""Whether two ``mpar plan --auto --json`` outputs pick the same: every candidate (all
fields, in order), the best plan and its config; then what was laid out and rejected.

    python benchmarks/results/plan_auto_speed/compare.py BEFORE.json AFTER.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["main"]


def main(before: str, after: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (before, after))
    same = a["candidates"] == b["candidates"]
    print(f"candidates equal: {same} ({len(a['candidates'])} and {len(b['candidates'])})")
    print(f"plan equal: {a['plan'] == b['plan']}, config equal: {a['config'] == b['config']}")
    for key in ("evaluated", "fitting", "rejected"):
        print(f"{key}: {a[key]} -> {b[key]}")
    for i, (x, y) in enumerate(zip(a["candidates"], b["candidates"])):
        if x != y:
            print(i, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)})
    return 0 if same and a["plan"] == b["plan"] and a["config"] == b["config"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
