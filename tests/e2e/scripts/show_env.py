"""Print the variables the launcher set up (for single-process checks)."""

import os
import sys

keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "MPAR_CONFIG", "MASTER_ADDR")
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), f"argv={sys.argv[1:]!r}", flush=True)
