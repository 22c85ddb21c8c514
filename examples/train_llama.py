"""Train a small Llama causal LM with mpar: bf16, ZeRO-2, pipeline 2 x data parallel 2.

    mpar launch --nproc-per-node 4 --config examples/configs/llama_bf16_zero2_pp2_dp2.json \\
        examples/train_llama.py

Tensor parallelism with the model's own ``base_model_tp_plan`` (no code change):

    mpar launch --nproc-per-node 4 --config examples/configs/llama_tp2_pp2.json \\
        examples/train_llama.py

The model is Hugging Face's ``LlamaForCausalLM`` built from a small
``LlamaConfig`` (library defaults otherwise; needs ``pip install transformers``,
part of ``.[dev]``) and trained exactly as in plain PyTorch: the loss is
computed inside the model from ``labels``. mpar profiles it, splits it into two
pipeline stages, computes in bfloat16 against float32 master weights, and
shards gradients and optimizer state over the two data-parallel replicas
(ZeRO-2). The data is synthetic: sequences count upward from a random start,
so the loss falls quickly as the model learns them.
"""

from __future__ import annotations

import argparse

import torch
from _flags import positive_int
from _progress import progress

import mpar


def batches(vocab: int, seq: int, batch: int, seed: int):
    """Endless batches of counting sequences; the model shifts the labels itself."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        tokens = (start + torch.arange(seq)) % vocab
        yield {"input_ids": tokens, "labels": tokens}


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)  # every rank builds the same initial model
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument(
        "--batch", type=positive_int, default=8, help="samples per step per replica"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG
    model = mpar.DistributedModel(build_model())
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    # data by replica (dp_rank), never by global rank: every rank of a pipeline
    # must see the same batch (with a Dataset: sampler=mpar.data_sampler(dataset))
    data = batches(128, 24, args.batch, seed=1 + mpar.dp_rank())
    bar = progress(args.steps, "llama")
    loss = float("nan")
    for step in range(1, args.steps + 1):
        losses = train_step(model, next(data))
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = float(losses.reduce_mean())
        if step == 1 and mpar.rank() == 0:
            print(
                f"mpar: {mpar.size()} processes, "
                f"pp={mpar.pp_size()} dp={mpar.dp_size()} tp={mpar.tp_size()}"
            )
            print(model.plan, flush=True)
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update()
    bar.close()
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}")
    mpar.shutdown()
    return loss


if __name__ == "__main__":
    main()
