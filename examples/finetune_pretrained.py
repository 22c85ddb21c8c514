"""Fine-tune a Hugging Face causal LM from a checkpoint directory, never whole on a rank.

    mpar launch --nproc-per-node 4 --config examples/configs/llama_zero3_pp2_dp2.json \\
        examples/finetune_pretrained.py --checkpoint /tmp/llama-small --out /tmp/llama-tuned

``--checkpoint`` is a Hugging Face checkpoint directory (``config.json`` and
safetensors weights, e.g. one ``huggingface-cli download`` fetched). The model
is whatever its ``config.json`` describes: built on the meta device from that
config (no rank allocates it), its weights loaded with ``mpar.load_pretrained``
(each rank reads only the elements it stores: at pp=2 x dp=2 ZeRO-3 a quarter
of the model), fine-tuned with ZeRO-3, and saved in Hugging Face format with
``mpar.save_pretrained``: ``AutoModelForCausalLM.from_pretrained(out)`` reads it.

Without hub access, make a small checkpoint first, in one process:

    python examples/finetune_pretrained.py --make-checkpoint /tmp/llama-small

(a randomly initialised 4-layer Llama, written sharded by ``transformers``'
``save_pretrained``). See docs/large_models.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _flags import at_least, positive_int
from _progress import progress
from train_llama import batches  # counting sequences

import mpar

HOW_TO_MAKE_ONE = (
    "make one offline with `python examples/finetune_pretrained.py --make-checkpoint "
    "/tmp/llama-small` (then pass --checkpoint /tmp/llama-small), or download one with "
    "`huggingface-cli download <repo> --local-dir <dir>`"
)


def make_checkpoint(path: Path) -> None:
    """A small randomly initialised Llama saved as a Hugging Face checkpoint, sharded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="1MB")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a Hugging Face checkpoint directory")
    parser.add_argument("--make-checkpoint", type=Path, metavar="DIR",
                        help="write a small Llama checkpoint to DIR and exit (no hub needed)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("/tmp/mpar-llama-tuned"))
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument(
        "--batch", type=positive_int, default=8, help="samples per step per replica"
    )
    parser.add_argument("--seq", type=at_least(2), default=24, help="tokens per sample")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    if args.make_checkpoint is None:
        if args.checkpoint is None:
            parser.error(f"--checkpoint DIR is required: {HOW_TO_MAKE_ONE}")
        if not (args.checkpoint / "config.json").is_file():
            parser.error(f"--checkpoint {args.checkpoint} has no config.json: {HOW_TO_MAKE_ONE}")
    return args


def main(argv: list[str] | None = None) -> float:
    args = _parse(argv)
    if args.make_checkpoint is not None:
        make_checkpoint(args.make_checkpoint)
        print(
            f"wrote {args.make_checkpoint}; fine-tune it with --checkpoint {args.make_checkpoint}"
        )
        return float("nan")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.checkpoint)  # the checkpoint's own config.json
    config.use_cache = False

    mpar.init()  # configuration from --config / MPAR_CONFIG
    # called under torch.device("meta"): nothing is allocated; this rank's share materializes later
    model = mpar.DistributedModel(lambda: AutoModelForCausalLM.from_config(config))
    mpar.load_pretrained(model, args.checkpoint)  # applied when the model is partitioned
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    seq = min(args.seq, config.max_position_embeddings)
    data = batches(config.vocab_size, seq, args.batch, seed=1 + mpar.dp_rank())  # by replica
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
        print(f"saved {args.out} (load it with AutoModelForCausalLM.from_pretrained)")
    mpar.shutdown()
    return loss


if __name__ == "__main__":
    main()
