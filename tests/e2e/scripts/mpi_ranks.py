"""Under mpiexec: sum the ranks with mpi4py; ``mpi_ranks.py raise 2`` / ``kill 1`` fail."""

import os
import signal
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1)
expected = comm.size * (comm.size + 1) // 2
print(
    f"rank={comm.rank} pid={os.getpid()} size={comm.size} sum={total} expected={expected} "
    f"omp={os.environ.get('OMP_NUM_THREADS')} config={os.environ.get('MPAR_CONFIG')} "
    f"args={sys.argv[1:]!r}",
    flush=True,
)
if len(sys.argv) > 2 and comm.rank == int(sys.argv[2]):
    time.sleep(0.3)
    if sys.argv[1] == "raise":
        raise RuntimeError(f"deliberate failure on rank {comm.rank}")
    os.kill(os.getpid(), signal.SIGKILL)
comm.Barrier()  # never completes when a rank failed
if total != expected:
    sys.exit(3)
