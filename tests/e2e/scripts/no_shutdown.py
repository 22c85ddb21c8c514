"""Trains a few ZeRO-3 steps over data parallelism and ends without mpar.shutdown()."""

import sys

import torch
from torch import nn

import mpar

mpar.init({"ddp": True, "zero": {"stage": 3}, "microbatches": 2})
torch.manual_seed(0)
model = mpar.DistributedModel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
opt = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


@mpar.step
def train(m, x, y):
    loss = nn.functional.cross_entropy(m(x), y)
    m.backward(loss)
    return loss


x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
for _ in range(3):
    train(model, x, y)
    opt.step()
    opt.zero_grad()
# One write per line: the ranks end together (shutdown's final barrier), and print's
# separate write of the newline let two ranks' lines run into each other.
sys.stdout.write(f"rank={mpar.rank()} done\n")
sys.stdout.flush()
