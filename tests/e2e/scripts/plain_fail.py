"""No MPI, no torch.distributed: rank ``argv[1]`` raises, the others sleep."""

import os
import sys
import time

rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
print(f"rank={rank} pid={os.getpid()} started", flush=True)
if rank == int(sys.argv[1]):
    raise ValueError(f"plain failure on rank {rank}")
time.sleep(600)
