"""Print the variables the launcher set up (for single-process checks)."""

import os
import sys

keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "MPAR_CONFIG", "MASTER_ADDR")
line = " ".join(f"{k}={os.environ.get(k)}" for k in keys) + f" argv={sys.argv[1:]!r}\n"
sys.stdout.write(line)  # one write: ranks share the launcher's (unbuffered) stdout
sys.stdout.flush()
