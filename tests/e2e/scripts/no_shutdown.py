"""Trains a few ZeRO-3 steps over data parallelism and ends without mpar.shutdown()."""

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
print(f"rank={mpar.rank()} done", flush=True)
