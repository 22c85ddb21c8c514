"""Fine-tune a Llama on long sequences with context parallelism: each sequence over 2 ranks.

    mpar launch --nproc-per-node 2 --config examples/configs/llama_cp2.json \\
        examples/finetune_long_context.py

The model is Hugging Face's ``LlamaForCausalLM`` (a small config; ``--pretrained DIR``
starts from a saved checkpoint instead, read with ``mpar.load_pretrained``) trained as
in plain PyTorch: ``model(**batch).loss``. With ``context_parallel_degree`` 2 the two
ranks take the same batch and mpar cuts every sequence between them (rank 0 the first
and last quarter, rank 1 the middle half); attention passes the keys and values round
the ring (``"all_to_all"`` in the config swaps sequence for heads instead). Each rank
keeps the activations of half of every sequence.

The data: documents of uneven lengths packed into long rows, ``position_ids`` restarting
at each document (each document attends only to itself; mpar balances the work per
document), the first token of every document without a target (``labels`` -100: nothing
predicts across a document boundary). Each document counts upward from a random start,
so the loss falls as the model learns to count.
"""

from __future__ import annotations

import argparse

import torch
from _flags import at_least, positive_int
from _progress import progress

import mpar


def packed_batches(vocab: int, seq: int, batch: int, seed: int):
    """Endless batches of rows of ``seq`` tokens, documents of 32 to ``seq // 2`` tokens
    (of ``seq // 4`` to ``seq // 2`` in rows shorter than 128)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids, positions, labels = [], [], []
        for _ in range(batch):
            row, pos = [], []
            while len(row) < seq:
                shortest = min(32, seq // 4)
                n = int(torch.randint(shortest, seq // 2, (1,), generator=g))
                n = min(n, seq - len(row))
                start = int(torch.randint(0, vocab, (1,), generator=g))
                row += [(start + i) % vocab for i in range(n)]
                pos += list(range(n))
            ids.append(torch.tensor(row))
            positions.append(torch.tensor(pos))
            target = torch.tensor(row)
            target[torch.tensor(pos) == 0] = -100  # a document's first token: no target
            labels.append(target)
        yield {
            "input_ids": torch.stack(ids),
            "position_ids": torch.stack(positions),
            "labels": torch.stack(labels),
        }


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        use_cache=False,
    )
    torch.manual_seed(0)  # every rank builds the same initial model
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument(
        "--seq", type=at_least(8), default=1024, help="tokens per row (divisible by 2 cp)"
    )
    parser.add_argument("--batch", type=positive_int, default=2, help="rows per step per replica")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--pretrained", default=None, help="a Hugging Face checkpoint dir")
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG
    model = mpar.DistributedModel(build_model())
    if args.pretrained:
        mpar.load_pretrained(model, args.pretrained)
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, batch):
        loss = model(**batch).loss  # the labels are shifted over the whole sequence
        model.backward(loss)
        return loss

    # data by replica (dp_rank): the ranks of a CP group take the same batch
    data = packed_batches(128, args.seq, args.batch, seed=1 + mpar.dp_rank())
    bar = progress(args.steps, "long context")
    loss = float("nan")
    for step in range(1, args.steps + 1):
        losses = train_step(model, next(data))
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = float(losses.reduce_mean())
        if step == 1 and mpar.rank() == 0:
            print(
                f"mpar: {mpar.size()} processes, pp={mpar.pp_size()} dp={mpar.dp_size()} "
                f"cp={mpar.cp_size()} ({mpar.config().context_parallel_method}), "
                f"{args.seq} tokens per sequence, {args.seq // mpar.cp_size()} per rank",
                flush=True,
            )
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update()
    bar.close()
    held = mpar.memory_report()[str(mpar.comm.state().device)]["activations"]
    print(f"rank {mpar.rank()}: activations kept for backward {held / 2**20:.1f} MiB", flush=True)
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}")
    mpar.shutdown()
    return loss


if __name__ == "__main__":
    main()
