"""A job that hangs on purpose: ``hang.py HOW RANK [TIMEOUT_S]``.

* ``sleep``: rank RANK sleeps inside its step function at the second step;
* ``barrier``: rank RANK calls an extra ``mpar.barrier()`` after the first step;
* ``all_reduce``: rank RANK calls an extra ``torch.distributed.all_reduce`` there;
* ``stop``: rank RANK stops itself (SIGSTOP) inside its step function: it cannot answer.

Two-stage pipeline (the config is given here unless ``MPAR_CONFIG`` is set), two
microbatches. The watchdog must end the job with a report naming the rank.
"""

import os
import signal
import sys
import time

import torch
import torch._dynamo  # now, not in the first step's profile (seconds on a busy machine)
import torch.distributed as dist
from torch import nn

import mpar

how, bad_rank = sys.argv[1], int(sys.argv[2])
timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 6.0
if os.environ.get("MPAR_CONFIG"):
    mpar.init()
else:
    mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": timeout_s})
torch.manual_seed(0)
model = mpar.DistributedModel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


@mpar.step
def train_step(model, x, y, step):
    out = model(x)
    if how == "sleep" and step == 1 and mpar.rank() == bad_rank:
        time.sleep(600)  # the rank that makes no progress
    if how == "stop" and step == 1 and mpar.rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    loss = nn.functional.mse_loss(out, y)
    model.backward(loss)
    return loss


x, y = torch.randn(8, 8), torch.randn(8, 4)
for step in range(3):
    train_step(model, x, y, step)
    # a line of its own even when mpiexec glues the ranks' output together
    print(f"\nrank={mpar.rank()} step={step} done at={time.time():.3f}", flush=True)
    if step == 0 and mpar.rank() == bad_rank:
        if how == "barrier":
            mpar.barrier()  # only this rank: a mismatched collective
        elif how == "all_reduce":
            dist.all_reduce(torch.ones(1))
print(f"rank={mpar.rank()} finished", flush=True)
