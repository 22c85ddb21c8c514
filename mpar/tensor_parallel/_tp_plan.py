"""Tensor-parallel plans: which module gets which style, found before anything is split.

A plan maps module-name patterns to styles, spelled as Hugging Face spells them.
A pattern matches a module when it equals the module's name, or its last
components (so Hugging Face's plans, written relative to the base model, match
inside any task head); ``*`` stands for exactly one name component
(``"layers.*.self_attn.q_proj"``). The first matching pattern wins.

Where the plan comes from (:func:`resolve_plan`): the config's ``tp_plan``; else
the model's own ``config.base_model_tp_plan`` (Llama, Mistral, Qwen2 have one);
else mpar's plan for its family (:data:`FAMILY_PLANS`: GPT-2, BERT, ViT, OPT, T5).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping

from torch import nn

from mpar._tp_styles import STYLES, Style, TPPlanError, parse_style

__all__ = [
    "FAMILY_PLANS",
    "STYLES",
    "USER_PLAN",
    "Style",
    "TPPlanError",
    "check_every_pattern",
    "match_plan",
    "match_summed",
    "name_matches",
    "parse_style",
    "resolve_plan",
]


FAMILY_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "h.*.attn.c_attn": "packed_colwise:3",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    "bert": {
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    },
    "vit": {
        "layers.*.attention.q_proj": "colwise",
        "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise",
        "layers.*.attention.o_proj": "rowwise",
        "layers.*.mlp.fc1": "colwise",
        "layers.*.mlp.fc2": "rowwise",
    },
    "opt": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.out_proj": "rowwise",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
    },
    "t5": {
        "block.*.layer.*.SelfAttention.q": "colwise",
        "block.*.layer.*.SelfAttention.k": "colwise",
        "block.*.layer.*.SelfAttention.v": "colwise",
        "block.*.layer.*.SelfAttention.o": "rowwise",
        "block.*.layer.*.SelfAttention.relative_attention_bias": "colwise",
        "block.*.layer.*.EncDecAttention.q": "colwise",
        "block.*.layer.*.EncDecAttention.k": "colwise",
        "block.*.layer.*.EncDecAttention.v": "colwise",
        "block.*.layer.*.EncDecAttention.o": "rowwise",
        "block.*.layer.*.DenseReluDense.wi": "colwise",
        "block.*.layer.*.DenseReluDense.wi_0": "colwise",
        "block.*.layer.*.DenseReluDense.wi_1": "colwise",
        "block.*.layer.*.DenseReluDense.wo": "rowwise",
    },
}
"""mpar's plans for Hugging Face families that ship none (keys relative to the base model)."""


USER_PLAN = "the config's tp_plan"
"""The source :func:`resolve_plan` gives a user's plan: every pattern of it must match."""


def _model_plan(module: nn.Module) -> tuple[dict[str, str] | None, str]:
    config = getattr(module, "config", None)
    own = getattr(config, "base_model_tp_plan", None)
    if own:
        return dict(own), f"{type(module).__name__}'s config.base_model_tp_plan"
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type in FAMILY_PLANS:
        return dict(FAMILY_PLANS[model_type]), f"mpar's plan for {model_type!r} models"
    return None, ""


def resolve_plan(
    module: nn.Module, user_plan: Mapping[str, str] | None
) -> tuple[dict[str, Style], str]:
    """The plan for ``module`` as ``{pattern: Style}`` and where it came from."""
    if user_plan is not None:
        plan, source = dict(user_plan), USER_PLAN
    else:
        found, source = _model_plan(module)
        if found is None:
            raise TPPlanError(
                f"tensor_parallel_degree > 1 but {type(module).__name__} has no tensor-parallel "
                "plan: it has no config.base_model_tp_plan and mpar ships none for it; give one "
                "in the config key 'tp_plan', e.g. {'blocks.*.attn.q': 'colwise', "
                "'blocks.*.attn.out': 'rowwise'} (module-name patterns, '*' = one name component)"
            )
        plan = found
    styles = {
        pattern: parse_style(style, f"{source} entry {pattern!r}")
        for pattern, style in plan.items()
    }
    return styles, source


def _component_match(pattern: list[str], name: list[str]) -> bool:
    return len(pattern) == len(name) and all(p in ("*", n) for p, n in zip(pattern, name))


def name_matches(pattern: str, name: str) -> bool:
    """Whether plan ``pattern`` matches module ``name``: it equals the name's last
    components, ``*`` standing for any one component."""
    want, have = pattern.split("."), name.split(".")
    return len(have) >= len(want) and _component_match(want, have[len(have) - len(want) :])


def _first_styles(
    module: nn.Module, plan: Mapping[str, Style]
) -> Iterator[tuple[str, nn.Module, Style]]:
    """``(name, submodule, style)`` for every submodule of ``module`` some pattern of
    ``plan`` matches, with the style of the first pattern that does."""
    for name, mod in module.named_modules():
        if not name:
            continue
        style = next((s for p, s in plan.items() if name_matches(p, name)), None)
        if style is not None:
            yield name, mod, style


def match_plan(module: nn.Module, plan: Mapping[str, Style]) -> dict[str, Style]:
    """Module name -> style, for every module of ``module`` some pattern matches
    (``"replicate"`` and ``"sequence_parallel"`` entries left out: neither splits)."""
    return {
        name: style
        for name, _, style in _first_styles(module, plan)
        if style.kind not in ("replicate", "sequence_parallel")
    }


def match_summed(module: nn.Module, plan: Mapping[str, Style]) -> dict[str, tuple[str, ...]]:
    """Module name -> its own parameters' names, for every module with parameters whose
    first matching pattern of ``plan`` is ``"replicated_with_grad_allreduce"`` (kept whole,
    gradients summed over TP)."""
    found: dict[str, tuple[str, ...]] = {}
    for name, mod, style in _first_styles(module, plan):
        own = tuple(n for n, _ in mod.named_parameters(recurse=False))
        if style.sum_grads and own:
            found[name] = own
    return found


def _suffixes(names: list[str], length: int) -> set[str]:
    """The last ``length`` components of each name: as written, with every number as
    ``*``, and with every number but the last as ``*`` (how plans name modules)."""
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        if len(parts) >= length:
            tail = parts[len(parts) - length :]
            starred = ["*" if p.isdigit() else p for p in tail]
            out.update(".".join(t) for t in (tail, starred, [*starred[:-1], tail[-1]]))
    return out


def check_every_pattern(module: nn.Module, plan: Mapping[str, Style], source: str) -> None:
    """Raise :class:`TPPlanError` naming each pattern of ``plan`` that matches no module
    of ``module`` and the closest module names (a misspelt pattern would otherwise leave
    its modules whole, and the first step fail deep in torch, or train a different model)."""
    names = [n for n, _ in module.named_modules() if n]
    unmatched = [p for p in plan if not any(name_matches(p, n) for n in names)]
    if not unmatched:
        return
    hints = []
    for pattern in unmatched:
        near = difflib.get_close_matches(
            pattern, sorted(_suffixes(names, pattern.count(".") + 1)), n=3, cutoff=0.5
        )
        hints.append(f"{pattern!r} (closest: {near or 'none'})")
    raise TPPlanError(
        f"{source}: {len(unmatched)} of its {len(plan)} patterns match no module of "
        f"{type(module).__name__}: {'; '.join(hints)}. A pattern names a module or the last "
        "components of its name, '*' standing for one component; module names look like "
        f"{names[:4]}"
    )
