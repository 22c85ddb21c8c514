"""All-reduce each rank's number with gloo; print what every rank saw."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
expected = world * (world + 1) / 2
print(
    f"rank={rank} world={world} local_rank={os.environ['LOCAL_RANK']} "
    f"sum={value.item():g} expected={expected:g} threads={torch.get_num_threads()} "
    f"omp={os.environ.get('OMP_NUM_THREADS')} args={sys.argv[1:]!r}",
    flush=True,
)
dist.destroy_process_group()
if value.item() != expected:
    sys.exit(3)
