"""Fine-tune a BERT sequence classifier with mpar: ZeRO-3 with CPU offload, pp 2 x dp 2.

    mpar launch --nproc-per-node 4 --config examples/configs/bert_zero3_offload.json \\
        examples/finetune_bert.py

The model is Hugging Face's ``BertForSequenceClassification`` built from a
small ``BertConfig`` (library defaults otherwise; needs ``pip install
transformers``, part of ``.[dev]``), with the loss computed inside the model
from ``labels``. mpar splits it into two pipeline stages and, within each
stage, shards parameters, gradients and optimizer state over the two
data-parallel replicas (ZeRO-3), keeping the optimizer state and the parameter
shards in CPU memory (offload). The task is synthetic: is the sentence's first
token in the upper half of the vocabulary? Accuracy on a held-out batch is
printed at the end (an evaluation step: no ``model.backward``).
"""

from __future__ import annotations

import argparse

import torch
from _flags import positive_int
from _progress import progress

import mpar

VOCAB, SEQ = 100, 16


def make_batch(batch: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
    labels = (ids[:, 0] >= VOCAB // 2).long()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def build_model():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
    )
    torch.manual_seed(0)  # every rank builds the same initial model
    return BertForSequenceClassification(config)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument(
        "--batch", type=positive_int, default=16, help="samples per step per replica"
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)

    mpar.init()  # configuration from --config / MPAR_CONFIG
    model = mpar.DistributedModel(build_model())
    optimizer = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @mpar.step
    def train_step(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    @mpar.step
    def predict(model, inputs):
        return model(**inputs).logits.argmax(-1) == inputs["labels"]

    # data by replica (dp_rank), never by global rank: every rank of a pipeline
    # must see the same batch (with a Dataset: sampler=mpar.data_sampler(dataset))
    g = torch.Generator().manual_seed(1 + mpar.dp_rank())
    bar = progress(args.steps, "bert")
    loss = float("nan")
    for step in range(1, args.steps + 1):
        losses = train_step(model, make_batch(args.batch, g))
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
        correct = predict(model, make_batch(args.batch, torch.Generator().manual_seed(99)))
    accuracy = float(correct.concat().float().mean())
    if mpar.rank() == 0:
        print(f"final loss {loss:.4f}, held-out accuracy {accuracy:.1%}")
    mpar.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
