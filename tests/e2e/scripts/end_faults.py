"""A job whose end goes wrong on purpose: ``end_faults.py HOW RANK TIMEOUT_S CKPT``.

* ``stuck``: after the last step, rank RANK sleeps while the others call
  ``mpar.shutdown()``;
* ``exit``: rank RANK calls ``sys.exit(0)`` after the first step, the others go on;
* ``skip_save``: rank RANK never reaches ``save_checkpoint`` (it sleeps instead).

Two-stage pipeline, two microbatches, small ``timeout_s``: the watchdog must name
rank RANK.
"""

import sys
import time

import torch
import torch._dynamo  # now, not in the first step's profile (seconds on a busy machine)
from torch import nn

import mpar

how, bad_rank, timeout_s, ckpt = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": timeout_s})
torch.manual_seed(0)
model = mpar.DistributedModel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


@mpar.step
def train_step(model, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


x, y = torch.randn(8, 8), torch.randn(8, 4)
for step in range(2):
    train_step(model, x, y)
    print(f"\nrank={mpar.rank()} step={step} done at={time.time():.3f}", flush=True)
    if how == "exit" and mpar.rank() == bad_rank:
        sys.exit(0)  # leaves early, "successfully"
if how == "skip_save":
    if mpar.rank() == bad_rank:
        time.sleep(600)  # never reaches the save
    mpar.save_checkpoint(ckpt, model)
if how == "stuck" and mpar.rank() == bad_rank:
    time.sleep(600)  # stuck after its last step
mpar.shutdown()
