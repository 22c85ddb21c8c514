"""Train a small CNN image classifier with mpar's simple (GPipe) schedule, pp 2.

    mpar launch --nproc-per-node 2 --config examples/configs/cnn_simple_pp2.json \\
        examples/train_cnn.py

The network is defined here (no torchvision): convolution blocks with batch
norm, global pooling and a linear head, written as an ``nn.Sequential``, so
mpar cuts it between blocks without tracing. The simple schedule runs every
microbatch's forward, then every backward. The images are synthetic: a bright
square in one of four quadrants, and the class is the quadrant.
"""

from __future__ import annotations

import argparse

import torch
from _flags import positive_int
from _progress import progress
from torch import nn

import mpar

SIZE = 32


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


def build_model() -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same initial model
    return nn.Sequential(
        block(3, 16),
        block(16, 32),
        block(32, 64),
        block(64, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 4),
    )


def make_batch(batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch, 3, SIZE, SIZE, generator=g) * 0.3
    labels = torch.randint(0, 4, (batch,), generator=g)
    half = SIZE // 2
    for i, quadrant in enumerate(labels.tolist()):
        top, left = (quadrant // 2) * half, (quadrant % 2) * half
        images[i, :, top + 4 : top + half - 4, left + 4 : left + half - 4] += 1.0
    return images, labels


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument(
        "--batch", type=positive_int, default=32, help="samples per step per replica"
    )
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG
    model = mpar.DistributedModel(build_model())
    optimizer = mpar.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    )

    @mpar.step
    def train_step(model, images, labels):
        loss = nn.functional.cross_entropy(model(images), labels)
        model.backward(loss)
        return loss

    @mpar.step
    def predict(model, images, labels):
        return model(images).argmax(-1) == labels

    # data by replica (dp_rank), never by global rank: every rank of a pipeline
    # must see the same batch (with a Dataset: sampler=mpar.data_sampler(dataset))
    g = torch.Generator().manual_seed(1 + mpar.dp_rank())
    bar = progress(args.steps, "cnn")
    loss = float("nan")
    for step in range(1, args.steps + 1):
        losses = train_step(model, *make_batch(args.batch, g))
        optimizer.step()
        optimizer.zero_grad()
        loss = float(losses.reduce_mean())
        if step == 1 and mpar.rank() == 0:
            print(model.plan, flush=True)
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update()
    bar.close()
    model.eval()
    with torch.no_grad():
        correct = predict(model, *make_batch(args.batch, torch.Generator().manual_seed(99)))
    accuracy = float(correct.concat().float().mean())
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}, held-out accuracy {accuracy:.1%}")
    mpar.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
