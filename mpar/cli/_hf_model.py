"""Build a Hugging Face model from its ``config.json`` on the meta device, with inputs.

``mpar plan --hf-config path/to/config.json`` plans a model from its
configuration alone: the architecture named in the config's ``architectures``
(else the causal-LM head of its ``model_type``) is built under
``torch.device("meta")`` (nothing is allocated, so a 70B model plans on a
laptop), and one microbatch of example inputs is synthesised from the model's
main input: token ids of ``seq_len`` for text models, images of the config's
``image_size`` for vision models, with ``labels`` so the loss computed inside
the model is part of the profile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["build_hf_model"]

_TOKEN_LABELS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
_CLASS_LABELS = ("ForSequenceClassification", "ForImageClassification")


def _read_config(path: str | Path) -> PretrainedConfig:
    import transformers

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--hf-config: {str(file)!r} does not exist")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--hf-config: cannot read {str(file)!r} as JSON: {exc}") from None
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not model_type:
        raise ValueError(
            f"--hf-config: {str(file)!r} has no 'model_type'; it must be a Hugging Face "
            "config.json (as written by save_pretrained)"
        )
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"--hf-config: {exc}".splitlines()[0]) from None


def _model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    import transformers

    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    auto = transformers.AutoModelForCausalLM
    try:  # transformers annotates the mapping's values loosely: they are model classes
        return cast("type[PreTrainedModel]", auto._model_mapping[type(config)])
    except KeyError:
        raise ValueError(
            f"--hf-config: the config names no architecture this transformers version has "
            f"({config.architectures}) and {config.model_type!r} has no causal-LM head; add "
            "the model class to 'architectures'"
        ) from None


def _inputs(
    model: nn.Module, config: PretrainedConfig, seq_len: int, batch: int
) -> dict[str, torch.Tensor]:
    import torch

    name = type(model).__name__
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        inputs = {main: torch.randn(batch, channels, size, size)}
    else:
        vocab = getattr(config, "vocab_size", None) or 2
        inputs = {main: torch.randint(0, vocab, (batch, seq_len))}
        if name.endswith(_TOKEN_LABELS):
            inputs["labels"] = inputs[main].clone()
    if name.endswith(_CLASS_LABELS):
        inputs["labels"] = torch.randint(0, max(getattr(config, "num_labels", 2), 1), (batch,))
    return inputs


def build_hf_model(
    path: str | Path, *, seq_len: int, batch: int
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model of the Hugging Face config at ``path`` on the meta device, and its inputs."""
    import torch

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError(
            "--hf-config needs the transformers package: pip install transformers"
        ) from None
    if seq_len < 1 or batch < 1:
        raise ValueError(f"--seq-len and --batch must be positive, got {seq_len} and {batch}")
    config = _read_config(path)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is longer than the model's max_position_embeddings {limit}"
        )
    cls = _model_class(config)
    with torch.device("meta"):
        model = cls(config)
    return model, _inputs(model, config, seq_len, batch)
