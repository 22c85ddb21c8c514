"""Train a small GPT-style language model with mpar (pipeline + data parallel).

    mpar launch --nproc-per-node 4 --config examples/configs/gpt_pp2_dp2.json examples/train_gpt.py

With pp=2 and dp=2 the model is profiled, auto-partitioned into two stages,
and trained with the interleaved (1F1B) schedule on 4 CPU processes. The data
is synthetic: each sequence counts upward from a random start (modulo the
vocabulary), so the loss falls quickly towards zero as the model learns it.
Runs unchanged under ``torchrun``, ``mpirun`` and ``srun``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _flags import positive_int
from _progress import progress

import mpar
from mpar.testing.models import GPTConfig, TinyGPT


def batches(vocab: int, seq: int, batch: int, seed: int):
    """Endless (inputs, targets) batches of counting sequences."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        tokens = (start + torch.arange(seq + 1)) % vocab
        yield tokens[:, :-1], tokens[:, 1:]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument(
        "--batch", type=positive_int, default=16, help="samples per step per replica"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG, or defaults
    cfg = GPTConfig(
        vocab_size=64,
        d_model=64,
        num_layers=4,
        num_heads=4,
        d_ffn=256,
        max_seq_len=32,
        tie_embeddings=False,
    )
    torch.manual_seed(0)  # every rank builds the same initial model
    model = mpar.DistributedModel(TinyGPT(cfg))
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, inputs, targets):
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        model.backward(loss)
        return loss

    # data by replica (dp_rank), never by global rank: every rank of a pipeline
    # must see the same batch (with a Dataset: sampler=mpar.data_sampler(dataset))
    data = batches(cfg.vocab_size, 16, args.batch, seed=1 + mpar.dp_rank())
    loss = float("nan")
    bar = progress(args.steps, "gpt")
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = next(data)
        losses = train_step(model, inputs, targets)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = float(losses.reduce_mean())
        if step == 1 and mpar.rank() == 0:
            print(f"mpar: {mpar.size()} processes, pp={mpar.pp_size()} dp={mpar.dp_size()}")
            print(model.plan, flush=True)
        rate = step * args.batch * mpar.dp_size() / (time.perf_counter() - started)
        bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:.1f}")
        bar.update()
    bar.close()
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}")
    mpar.shutdown()
    return loss


if __name__ == "__main__":
    main()
