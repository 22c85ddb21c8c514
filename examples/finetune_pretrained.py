"""Fine-tune a Hugging Face model from a checkpoint directory, never whole on a rank.

    mpar launch --nproc-per-node 4 --config examples/configs/llama_zero3_pp2_dp2.json \\
        examples/finetune_pretrained.py --checkpoint /tmp/llama-small --out /tmp/llama-tuned

With no hub access, the script first writes a small pretrained-style checkpoint
with ``mpar.save_pretrained`` (sharded safetensors, index, ``config.json``) unless
``--checkpoint`` already holds one. Then it does what you would do with a real
checkpoint: builds the model on the meta device from a factory (no rank
allocates it), loads the weights with ``mpar.load_pretrained`` (each rank reads
only the elements it stores: at pp=2 x dp=2 ZeRO-3 a quarter of the model),
fine-tunes it at pp=2 x dp=2 with ZeRO-3, and saves the result in Hugging Face
format with ``mpar.save_pretrained``: ``LlamaForCausalLM.from_pretrained(out)``
reads it. See docs/large_models.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _progress import progress
from train_llama import batches  # counting sequences

import mpar


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )


def factory():
    """Called by mpar under ``torch.device("meta")``: nothing is allocated."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def write_checkpoint(path: Path) -> None:
    """Stand-in for a downloaded checkpoint: a model initialised by mpar, saved sharded."""
    with torch.device("meta"):
        module = factory()
    mpar.materialize(module, seed=0)  # initialised in this process, as mpar would
    mpar.save_pretrained(mpar.DistributedModel(module), path, max_shard_size="1MB")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/mpar-llama-small"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/mpar-llama-tuned"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="samples per step per replica")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG
    if not (args.checkpoint / "config.json").is_file():
        write_checkpoint(args.checkpoint)

    model = mpar.DistributedModel(factory)  # on meta; this rank's share materializes later
    mpar.load_pretrained(model, args.checkpoint)  # applied when the model is partitioned
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    data = batches(128, 24, args.batch, seed=1 + mpar.dp_rank())  # by replica
    bar = progress(args.steps, "finetune")
    loss = float("nan")
    for step in range(1, args.steps + 1):
        losses = train_step(model, next(data))
        optimizer.step()
        optimizer.zero_grad()
        loss = float(losses.reduce_mean())
        if step == 1 and mpar.rank() == 0:
            print(f"mpar: {mpar.size()} processes, pp={mpar.pp_size()} dp={mpar.dp_size()}")
            print(f"first loss {loss:.4f}")
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update()
    bar.close()
    mpar.save_pretrained(model, args.out, max_shard_size="1MB")
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}")
        print(f"saved {args.out} (load it with LlamaForCausalLM.from_pretrained)")
    mpar.shutdown()
    return loss


if __name__ == "__main__":
    main()
