"""Fail on one rank in the middle of a step: ``fail.py raise 2`` or ``fail.py kill 1``.

The other ranks block in an all_reduce that can never complete, so only the
launcher stopping them ends the job.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

how, bad_rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
print(f"rank={rank} pid={os.getpid()} started", flush=True)
dist.barrier()
if rank == bad_rank:
    time.sleep(0.5)
    if how == "raise":
        raise RuntimeError(f"deliberate failure on rank {rank}")
    os.kill(os.getpid(), signal.SIGKILL)
value = torch.ones(1)
dist.all_reduce(value)  # rank `bad_rank` never joins
time.sleep(600)
