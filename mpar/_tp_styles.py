"""Tensor-parallel style names, parsed (a leaf: ``config`` checks a ``tp_plan`` with it,
``partition`` and ``tensor_parallel`` read the parsed :class:`Style`).

A style is spelled as Hugging Face spells it (``"colwise"``, ``"rowwise"``, ...);
:mod:`mpar.tensor_parallel` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpar.errors import ConfigError

__all__ = ["STYLES", "Style", "TPPlanError", "parse_style"]


class TPPlanError(ConfigError):
    """A tensor-parallel plan that cannot be applied to this model."""


@dataclass(frozen=True)
class Style:
    """How one module is split across the TP group."""

    kind: str
    """``"colwise"`` (output features split), ``"rowwise"`` (input features split),
    ``"embedding_rowwise"`` (vocabulary split), ``"replicate"``, or
    ``"sequence_parallel"`` (nothing split; the entry turns sequence parallelism on,
    see ``mpar.tensor_parallel._sequence``)."""
    gather_output: bool = False
    """colwise: all-gather the output pieces (the next module needs the whole output)."""
    split_input: bool = False
    """rowwise: the input arrives whole; take this rank's piece first."""
    packs: int = 1
    """colwise: the output features are ``packs`` equal blocks split each (fused q|k|v)."""
    sum_grads: bool = False
    """replicate: the module's own parameters' gradients are summed over TP (a norm
    between a colwise and a rowwise layer, Qwen3's per-head ``q_norm``, sees only this
    rank's heads)."""


STYLES: dict[str, Style] = {
    "colwise": Style("colwise"),
    "colwise_rep": Style("colwise", gather_output=True),
    "colwise_gather_output": Style("colwise", gather_output=True),
    "rowwise": Style("rowwise"),
    "rowwise_rep": Style("rowwise", split_input=True),
    "rowwise_split_input": Style("rowwise", split_input=True),
    "embedding_rowwise": Style("embedding_rowwise"),
    "packed_colwise": Style("colwise", packs=2),
    "replicate": Style("replicate"),
    "replicated_with_grad_allreduce": Style("replicate", sum_grads=True),
    "sequence_parallel": Style("sequence_parallel"),
    "moe_tp_experts": Style("replicate"),
}
"""The style names a plan may use; ``"packed_colwise:k"`` packs ``k`` blocks.
``"rowwise_split_input"`` is ``"rowwise_rep"`` (Phi-3's plan spells it so).
``"moe_tp_experts"`` (Hugging Face's MoE plans name the experts module so) keeps the
experts whole on every TP rank: ``expert_parallel_degree`` splits them."""


def parse_style(name: object, where: str) -> Style:
    """The :class:`Style` spelled ``name`` (``where`` names the plan entry in errors)."""
    if not isinstance(name, str):
        raise TPPlanError(f"{where}: a style must be a string, got {name!r}")
    base, _, count = name.partition(":")
    if base == "packed_colwise" and count:
        if not count.isdigit() or int(count) < 1:
            raise TPPlanError(
                f"{where}: 'packed_colwise:k' needs a block count k >= 1, got {name!r}"
            )
        return Style("colwise", packs=int(count))
    if count or base not in STYLES:
        raise TPPlanError(
            f"{where}: unknown tensor-parallel style {name!r}; use one of "
            f"{sorted(STYLES)} or 'packed_colwise:k'"
        )
    return STYLES[base]
