"""Fine-tune a Mixtral (mixture of experts) at expert parallel 2 x pipeline 2.

    mpar launch --nproc-per-node 4 --config examples/configs/mixtral_ep2_pp2.json \\
        examples/finetune_mixtral.py --checkpoint /tmp/mixtral-small --out /tmp/mixtral-tuned

With no hub access, the script first writes a small Mixtral checkpoint the way
transformers writes one (``save_pretrained``: experts stored per expert,
``block_sparse_moe.experts.{e}.w1``) unless ``--checkpoint`` already holds one. Then:
the model is split into two pipeline stages, and each MoE layer's 8 experts over the
two ranks of each stage's ep group (4 experts each, tokens sent to their experts'
ranks and back); ``mpar.load_pretrained`` reads on each rank only its stage's layers
and its own experts; training adds the router balance loss (``output_router_logits``),
computed as one process would on the whole batch; ``mpar.save_pretrained`` writes
the result, which ``MixtralForCausalLM.from_pretrained`` reads. See
docs/expert_parallel.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _flags import positive_int
from _progress import progress
from train_llama import batches  # counting sequences

import mpar


def mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        use_cache=False,
    )
    torch.manual_seed(seed)  # every rank builds the same model
    return MixtralForCausalLM(config)


def write_checkpoint(path: Path) -> None:
    """Stand-in for a downloaded checkpoint: transformers' own save_pretrained (rank 0)."""
    if mpar.rank() == 0 and not (path / "config.json").is_file():
        mixtral(seed=1).save_pretrained(path)
    mpar.barrier()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/mpar-mixtral-small"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/mpar-mixtral-tuned"))
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument(
        "--batch", type=positive_int, default=8, help="samples per step per replica"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG
    write_checkpoint(args.checkpoint)
    data = batches(128, 24, args.batch, seed=1 + mpar.dp_rank())  # by replica
    first = next(data)
    # Partitioned now (from a microbatch), so that load_pretrained reads only this
    # rank's share: its stage's layers, its experts.
    model = mpar.DistributedModel(mixtral(), example_kwargs={k: v[:2] for k, v in first.items()})
    mpar.load_pretrained(model, args.checkpoint)
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, inputs):
        out = model(**inputs)
        model.backward(out.loss)  # cross-entropy + router_aux_loss_coef x balance loss
        return torch.stack([out.loss, out.aux_loss])

    if mpar.rank() == 0:
        print(
            f"mpar: {mpar.size()} processes, pp={mpar.pp_size()} dp={mpar.dp_size()} "
            f"ep={mpar.ep_size()}: {8 // mpar.ep_size()} experts of 8 per rank and layer"
        )
    bar = progress(args.steps, "finetune")
    loss = float("nan")
    inputs = first
    for step in range(1, args.steps + 1):
        both = train_step(model, inputs).reduce_mean()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss, aux = float(both[0]), float(both[1])
        if step == 1 and mpar.rank() == 0:
            print(f"first loss {loss:.4f} (balance loss {aux:.4f})")
        bar.set_postfix(loss=f"{loss:.4f}", balance=f"{aux:.3f}")
        bar.update()
        inputs = next(data)
    bar.close()
    mpar.save_pretrained(model, args.out)
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}")
        print(f"saved {args.out} (load it with MixtralForCausalLM.from_pretrained)")
    mpar.shutdown()
    return loss


if __name__ == "__main__":
    main()
