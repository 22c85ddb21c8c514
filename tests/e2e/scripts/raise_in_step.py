"""Rank RANK raises inside its step function at the second step: ``raise_in_step.py RANK``.

Two-stage pipeline: the step body runs on the last stage (rank 1).
"""

import sys

import torch
from torch import nn

import mpar

mpar.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 30})
torch.manual_seed(0)
model = mpar.DistributedModel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


@mpar.step
def train_step(model, x, y, step):
    out = model(x)
    if step == 1 and mpar.rank() == int(sys.argv[1]):
        raise RuntimeError("deliberate failure in the step")
    loss = nn.functional.mse_loss(out, y)
    model.backward(loss)
    return loss


x, y = torch.randn(8, 8), torch.randn(8, 4)
for step in range(3):
    train_step(model, x, y, step)
mpar.shutdown()
