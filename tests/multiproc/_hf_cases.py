"""Hugging Face model families, built from small configs with the library's defaults.

Each family is trained with the loss computed inside the model from ``labels``
(the way most users train them). Defaults are kept, ``use_cache`` included;
only sizes are made small and dropout is set to zero, so that one-process
training on the whole batch is an exact oracle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "t5", "bert", "vit")
MORE_FAMILIES = (
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt_neox",
    "opt",
    "falcon",
    "stablelm",
)
"""Causal LMs with two blocks, built by :func:`build` like ``FAMILIES`` (their own tests)."""
BATCH = 8  # global batch per step
VOCAB = 96
_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)


def build(family: str) -> nn.Module:
    """The family's model, seeded so every process builds the same weights."""
    import transformers as hf

    torch.manual_seed(0)
    if family == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**_DECODER))
    if family == "mistral":
        return hf.MistralForCausalLM(hf.MistralConfig(**_DECODER, sliding_window=8))
    if family == "qwen2":
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(**_DECODER))
    if family == "gpt2":
        cfg = hf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        return hf.GPT2LMHeadModel(cfg)
    if family == "t5":
        t5 = hf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        t5.dropout_rate, t5.decoder_start_token_id = 0.0, 0  # as t5-small's config.json has
        return hf.T5ForConditionalGeneration(t5)
    if family == "bert":
        bert = hf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=3,
        )
        bert.hidden_dropout_prob = bert.attention_probs_dropout_prob = 0.0
        return hf.BertForSequenceClassification(bert)
    if family == "vit":
        vit = hf.ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=5,
        )
        return hf.ViTForImageClassification(vit)
    if family in MORE_FAMILIES:
        return _more(hf, family)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + MORE_FAMILIES}")


def _more(hf: Any, family: str) -> nn.Module:
    """One of ``MORE_FAMILIES``: two blocks, ids and head sizes fitted to the vocabulary."""
    small = {**_DECODER, "num_hidden_layers": 2}
    if family == "qwen3":  # per-head q_norm / k_norm
        return hf.Qwen3ForCausalLM(hf.Qwen3Config(**small, head_dim=8))
    if family == "gemma":  # embedding scaled by sqrt(hidden), tied head, pad id 0
        return hf.GemmaForCausalLM(hf.GemmaConfig(**small, head_dim=8))
    if family == "gemma2":  # attention and final logit soft-capping
        return hf.Gemma2ForCausalLM(hf.Gemma2Config(**small, head_dim=8))
    if family == "gemma3":
        return hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(**small, head_dim=8))
    if family == "phi3":  # fused q|k|v and gate|up
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return hf.Phi3ForCausalLM(hf.Phi3Config(**small, **ids))
    if family == "gpt_neox":  # fused query_key_value
        del small["num_key_value_heads"]
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**small))
    if family == "stablelm":
        return hf.StableLmForCausalLM(hf.StableLmConfig(**small))
    if family == "opt":
        opt = hf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        )
        opt.dropout = 0.0
        return hf.OPTForCausalLM(opt)
    falcon = hf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    return hf.FalconForCausalLM(falcon)


def batch(family: str, step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: the model's keyword inputs, ``labels`` included."""
    g = torch.Generator().manual_seed(100 + step)
    if family == "t5":
        return {
            "input_ids": torch.randint(1, VOCAB, (BATCH, 10), generator=g),
            "labels": torch.randint(1, VOCAB, (BATCH, 6), generator=g),
        }
    if family == "bert":
        return {
            "input_ids": torch.randint(0, VOCAB, (BATCH, 12), generator=g),
            "labels": torch.randint(0, 3, (BATCH,), generator=g),
        }
    if family == "vit":
        return {
            "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (BATCH,), generator=g),
        }
    ids = torch.randint(0, VOCAB, (BATCH, 12), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # A larger eps keeps Adam from turning float noise on near-zero gradients
    # into lr-sized steps (see DESIGN.md, correctness oracle).
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4)


def reference(family: str, steps: int) -> dict[str, Any]:
    """One process, the whole batch, plain torch."""
    net = build(family)
    opt = _optimizer(net.parameters())
    losses = []
    for s in range(steps):
        loss = net(**batch(family, s)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()}}


def train_family(family: str, steps: int) -> dict[str, Any]:
    """Train one family with mpar (``mpar.init`` already called) on this replica's shard."""
    import mpar

    model = mpar.DistributedModel(build(family))
    opt = mpar.DistributedOptimizer(_optimizer(model.parameters()))

    @mpar.step
    def train_step(m: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = m(**inputs).loss
        m.backward(loss)
        return loss

    dp, rank = mpar.dp_size(), mpar.dp_rank()
    shard = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    losses = []
    for s in range(steps):
        inputs = {k: v[shard] for k, v in batch(family, s).items()}
        losses.append(float(train_step(model, inputs).reduce_mean()))
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    whole = dict(build(family).named_parameters())
    if hasattr(model.plan, "stages"):  # one TP rank's: split parameters 1/tp
        counts = [stage.param_count for stage in model.plan.stages]
        tp, split = mpar.tp_size(), {} if model.tp_layout is None else model.tp_layout.shards
        expected = sum(p.numel() // tp if n in split else p.numel() for n, p in whole.items())
    else:  # one stage, not profiled: the whole model
        counts = [sum(p.numel() for name, p in state.items() if name in whole)]
        expected = sum(p.numel() for p in whole.values())
    devices = sorted({p.device.type for p in model.local_parameters()})
    layout = model.tp_layout
    vocabulary = () if layout is None else layout.vocabulary
    held = model.local_tensors()  # this rank's stages': at pp > 1 one of the two, or none
    here = tuple(n for n in vocabulary if f"{n}.weight" in held)
    vocab_tensors = {id(held[f"{n}.weight"]): held[f"{n}.weight"] for n in here}
    return {
        "vocabulary": vocabulary,  # the embedding and LM head split by the vocabulary
        "vocab_bytes": sum(t.numel() * t.element_size() for t in vocab_tensors.values()),
        "vocab_whole_bytes": _whole_bytes(whole, here),
        "losses": losses,
        "state": state,
        "plan_param_counts": counts,
        "plan_param_expected": expected,
        "param_devices": devices,
        "sequence_parallel": layout is not None and layout.sequence is not None,
    }


def _whole_bytes(whole: dict[str, nn.Parameter], modules: tuple[str, ...]) -> int:
    """Bytes of the whole weights of ``modules`` (a tied weight once)."""
    tensors = {
        id(whole[f"{n}.weight"]): whole[f"{n}.weight"] for n in modules if f"{n}.weight" in whole
    }
    return sum(t.numel() * t.element_size() for t in tensors.values())


def train_ranks(families: list[str], config: dict[str, Any], steps: int) -> dict[str, Any]:
    """Rank body: every family under ``config``, in one set of processes."""
    import mpar

    mpar.init(config)
    return {family: train_family(family, steps) for family in families}
