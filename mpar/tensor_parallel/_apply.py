"""Turning a module into this rank's tensor-parallel share of it.

:func:`plan_layout` checks a plan against the whole model when it is wrapped
(before any step): every planned module has a supported type, every split size
and head count divides by the TP degree, and no split weight is shared with a
module that uses it whole. :func:`apply_layout` then, on every rank, keeps this
rank's piece of each split parameter and gives each planned module a forward
that communicates through the TP operators of :mod:`mpar.comm._tp_ops`:

=====================  ==================================  ==========================
style                  parameters kept                     forward
=====================  ==================================  ==========================
colwise (Linear)       rows of ``weight``, of ``bias``     ``tp_copy`` input, local
                                                           output (``tp_gather`` for
                                                           ``colwise_rep``)
colwise (Conv1D)       columns of ``weight``, ``bias``     the same
colwise (Embedding)    columns (embedding features)        local output features
rowwise (Linear)       columns of ``weight``; ``bias``     ``tp_reduce`` the partial
                       whole                               product, then add ``bias``
rowwise (Conv1D)       rows of ``weight``                  the same
embedding_rowwise      rows (vocabulary) of ``weight``     out-of-range ids give 0,
                                                           ``tp_reduce``
=====================  ==================================  ==========================

Modules holding a split module keep their head counts right: integer attributes
named like head counts (:data:`HEAD_ATTRS`) are divided by the TP degree, so a
reshape by ``self.num_heads`` stays right. A model whose reshapes take the head
count from the tensor (``view(b, t, -1, head_dim)``, as Hugging Face's models do)
needs nothing else.

Replicated parameters (norms, embeddings left whole, rowwise biases) see the same
inputs on every TP rank, so their gradients agree without communication; those of a
``"replicated_with_grad_allreduce"`` module (a per-head norm between the split layers,
which sees only this rank's heads) are used through ``tp_copy``, their gradients summed. With
sequence parallelism (:mod:`mpar.tensor_parallel._sequence`) a rowwise module inside a
block reduce-scatters its output along the sequence instead (``tp_reduce_scatter``),
and the parameters between the split layers have their gradients summed over TP.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mpar.comm._tp_ops import tp_copy, tp_gather, tp_reduce, tp_reduce_scatter, tp_split
from mpar.tensor_parallel._probe import check_inferred_heads
from mpar.tensor_parallel._sequence import (
    SequenceLayout,
    apply_sequence,
    check_stream,
    plan_sequence,
    summing_grads,
)
from mpar.tensor_parallel._tp_plan import (
    STYLES,
    USER_PLAN,
    Style,
    TPPlanError,
    check_every_pattern,
    match_plan,
    match_summed,
)
from mpar.tensor_parallel._vocab import use_vocab_parallel_loss, vocab_plan

__all__ = ["HEAD_ATTRS", "TPLayout", "TPShard", "apply_layout", "plan_layout"]

HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_heads",
    "n_head",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "all_head_size",
    "inner_dim",
    "split_size",
)
"""Attributes of a split module's parent (and of a Hugging Face config: the head
counts) that count heads or split features, divided by the TP degree."""

_CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


@dataclass(frozen=True)
class TPShard:
    """How one parameter is split: along ``dim``, in ``packs`` equal blocks each split
    ``size`` ways (rank ``r`` keeps piece ``r`` of every block)."""

    dim: int
    size: int
    packs: int = 1

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole tensor ``full``."""
        blocks = full.chunk(self.packs, self.dim)
        return torch.cat([b.chunk(self.size, self.dim)[rank] for b in blocks], self.dim)

    def local_shape(self, shape: torch.Size) -> torch.Size:
        out = list(shape)
        out[self.dim] //= self.size
        return torch.Size(out)

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece, in TP rank order."""
        per_rank = [p.chunk(self.packs, self.dim) for p in pieces]
        return torch.cat(
            [per_rank[r][j] for j in range(self.packs) for r in range(self.size)], self.dim
        )

    def whole_index(self, length: int, index: int, rank: int) -> tuple[int, int]:
        """Where index ``index`` along ``dim`` of rank ``rank``'s piece lies in the whole
        tensor (whose ``dim`` has ``length``), and how many indices of the piece from it
        on stay consecutive there (to the end of its block)."""
        step = length // (self.packs * self.size)
        block, within = divmod(index, step)
        return (block * self.size + rank) * step + within, step - within

    def boxes(self, shape: torch.Size, rank: int) -> list[tuple[int, int]]:
        """``(offset, length)`` along ``dim`` of the whole tensor that rank ``rank``'s piece
        holds, block by block (its piece is their concatenation)."""
        block = shape[self.dim] // self.packs
        step = block // self.size
        return [(j * block + rank * step, step) for j in range(self.packs)]


@dataclass
class TPLayout:
    """The checked plan of one model: modules' styles and parameters' splits."""

    size: int
    modules: dict[str, Style]
    """Module name -> style (only split modules)."""
    shards: dict[str, TPShard] = field(default_factory=dict)
    """Parameter name (the original model's) -> its split; absent: replicated."""
    source: str = ""
    """Where the plan came from (for messages)."""
    sequence: SequenceLayout | None = None
    """Where sequence parallelism splits the sequence (None: it is off)."""
    summed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Module name -> its own parameters, kept whole, whose gradients are summed over TP
    (``"replicated_with_grad_allreduce"``: Qwen3's and Gemma 3's per-head ``q_norm`` and
    ``k_norm``, which see only this rank's heads)."""
    vocabulary: tuple[str, ...] = ()
    """The token embedding and LM head mpar split by the vocabulary on its own (a model's
    own or family plan at a degree dividing the vocabulary; ``mpar.tensor_parallel._vocab``)."""


def _weight_dims(module: nn.Module, style: Style) -> tuple[int, int | None]:
    """(dim of ``weight`` split, dim of ``bias`` split or None) for ``module`` under ``style``."""
    conv1d = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    if isinstance(module, nn.Embedding):
        if style.kind == "colwise":
            return 1, None
        if style.kind == "embedding_rowwise":
            return 0, None
    elif isinstance(module, nn.Linear) or conv1d:
        out_dim, in_dim = (1, 0) if conv1d else (0, 1)
        if style.kind == "colwise":
            return out_dim, 0
        if style.kind == "rowwise":
            return in_dim, None
    raise TPPlanError(
        f"module of type {type(module).__name__} cannot take the tensor-parallel style "
        f"{style.kind!r}: colwise and rowwise split nn.Linear and transformers' Conv1D, "
        "colwise and embedding_rowwise split nn.Embedding"
    )


def _check_divisible(what: str, value: int, tp: int, hint: str) -> None:
    if value % tp:
        raise TPPlanError(
            f"{what} is {value}, not divisible by tensor_parallel_degree {tp}; {hint}"
        )


def plan_layout(
    module: nn.Module,
    plan: dict[str, Style],
    tp: int,
    source: str,
    *,
    sequence_parallel: bool = False,
) -> TPLayout:
    """Check ``plan`` against ``module`` for TP degree ``tp`` (with sequence parallelism
    if ``sequence_parallel``); raises :class:`TPPlanError` naming the module and the
    numbers when it cannot be applied. Every pattern of a user's plan (``source`` is
    :data:`USER_PLAN`) must match a module; a model's own plan may name modules that
    only some of its configurations have. A plan that is not the user's gets the
    vocabulary split of a Hugging Face causal LM's embedding and head (``vocab_plan``)."""
    if source == USER_PLAN:
        check_every_pattern(module, plan, source)
        vocabulary: dict[str, str] = {}
    else:
        vocabulary = vocab_plan(module, tp)
        plan = {**plan, **{name: STYLES[style] for name, style in vocabulary.items()}}
    styles = match_plan(module, plan)
    if not styles:
        raise TPPlanError(
            f"{source} matches no module of {type(module).__name__} (patterns: "
            f"{sorted(plan)}); module names look like "
            f"{[n for n, _ in module.named_modules()][1:6]}"
        )
    split_vocabulary = tuple(n for n in vocabulary if styles.get(n) == STYLES[vocabulary[n]])
    layout = TPLayout(
        tp,
        styles,
        source=source,
        summed=match_summed(module, plan),
        vocabulary=split_vocabulary,
    )
    owner: dict[int, tuple[str, TPShard | None]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        style = styles.get(mod_name)
        for p_name, param in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            shard = None
            if style is not None:
                w_dim, b_dim = _weight_dims(mod, style)
                dim = {"weight": w_dim, "bias": b_dim}.get(p_name)
                if dim is not None:
                    packs = style.packs if style.kind == "colwise" else 1
                    shard = TPShard(dim, tp, packs)
                    size = param.shape[dim]
                    if size % (packs * tp):
                        raise TPPlanError(
                            f"{full}: dimension {dim} of shape {tuple(param.shape)} has {size} "
                            f"elements, which do not split into {packs} block(s) x "
                            f"tensor_parallel_degree {tp}; pick a degree that divides it, or "
                            "leave the module out of the plan ('replicate')"
                        )
            seen = owner.get(id(param))
            if seen is not None and seen[1] != shard:
                raise TPPlanError(
                    f"parameter {full} is shared with {seen[0]} but the plan splits one use and "
                    "not the other (a tied weight); mark both modules 'replicate' in tp_plan, or "
                    "split both the same way"
                )
            owner.setdefault(id(param), (full, shard))
            if shard is not None and seen is None:
                layout.shards[full] = shard
    _check_heads(module, styles, tp)
    _check_inferred(module, styles, layout.shards, tp)
    if sequence_parallel:
        layout.sequence = plan_sequence(module, styles, set(layout.shards), tp)
    return layout


def _parents(styles: dict[str, Style]) -> set[str]:
    """Modules holding a colwise module that leaves its output split (one gathering its
    output, Phi-3's ``"colwise_gather_output"`` fused q|k|v, leaves the heads whole)."""
    return {
        name.rpartition(".")[0]
        for name, s in styles.items()
        if s.kind == "colwise" and not s.gather_output
    }


def _head_counts(
    module: nn.Module, styles: dict[str, Style]
) -> list[tuple[str, nn.Module, str, int]]:
    """``(parent name, parent, attribute, value)`` for every head-count attribute
    (:data:`HEAD_ATTRS`) of a module holding a colwise-split module."""
    found = []
    for parent in sorted(_parents(styles)):
        mod = module.get_submodule(parent) if parent else module
        for attr in HEAD_ATTRS:
            value = mod.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((parent, mod, attr, value))
    return found


def _check_heads(module: nn.Module, styles: dict[str, Style], tp: int) -> None:
    config = getattr(module, "config", None)
    for attr in _CONFIG_HEADS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            _check_divisible(
                f"{type(module).__name__}: config.{attr}",
                value,
                tp,
                "each tensor-parallel rank computes whole attention heads; pick a "
                "tensor_parallel_degree that divides the head counts",
            )
    for parent, mod, attr, value in _head_counts(module, styles):
        _check_divisible(
            f"module {parent or '<root>'} ({type(mod).__name__}): {attr}",
            value,
            tp,
            "each tensor-parallel rank computes whole attention heads; pick a "
            "tensor_parallel_degree that divides it",
        )


def _check_inferred(
    module: nn.Module, styles: dict[str, Style], shards: dict[str, TPShard], tp: int
) -> None:
    """Probe each kind of module holding a colwise-split module whose head count is
    neither an attribute of :data:`HEAD_ATTRS` nor in a Hugging Face config (whose
    models take heads from the tensors): :func:`check_inferred_heads`."""
    config = getattr(module, "config", None)
    if any(type(getattr(config, a, None)) is int for a in _CONFIG_HEADS):
        return
    probed: set[tuple[object, ...]] = set()
    for parent_name in sorted(_parents(styles)):
        parent = module.get_submodule(parent_name) if parent_name else module
        if any(type(parent.__dict__.get(a)) is int for a in HEAD_ATTRS):
            continue
        prefix = f"{parent_name}." if parent_name else ""
        planned = {
            n: (module.get_submodule(n), st) for n, st in styles.items() if n.startswith(prefix)
        }
        planned = dict(sorted(planned.items(), key=lambda item: item[1][1].kind != "colwise"))
        kind = (
            type(parent),
            tuple((n[len(prefix) :], st, m.weight.shape) for n, (m, st) in planned.items()),
        )
        if kind in probed:
            continue
        probed.add(kind)
        local = {k[len(prefix) :]: v for k, v in shards.items() if k.startswith(prefix)}
        label = f"module {parent_name or '<root>'} ({type(parent).__name__})"
        check_inferred_heads(parent, label, planned, local, tp, HEAD_ATTRS)


# -- applying ---------------------------------------------------------------------------


def _local_param(param: nn.Parameter, shard: TPShard, rank: int) -> None:
    if param.is_meta:
        param.data = torch.empty(shard.local_shape(param.shape), dtype=param.dtype, device="meta")
    else:
        param.data = shard.local(param.data, rank).clone()


Forward = Callable[..., torch.Tensor]
"""A replacement ``forward(self, x)`` of a split module."""


class _Conv1D(Protocol):
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer with its weight transposed."""

    weight: torch.Tensor
    bias: torch.Tensor


def _linear_colwise(style: Style, group: str) -> Forward:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(tp_copy(x, group), self.weight, self.bias)
        return tp_gather(out, -1, group) if style.gather_output else out

    return forward


def _conv1d_colwise(style: Style, group: str) -> Forward:
    def forward(self: _Conv1D, x: torch.Tensor) -> torch.Tensor:
        x = tp_copy(x, group)
        weight: torch.Tensor = self.weight
        shape = (*x.shape[:-1], weight.shape[1])
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), weight).view(shape)
        return tp_gather(out, -1, group) if style.gather_output else out

    return forward


def _rowwise_sum(
    partial: torch.Tensor, bias: torch.Tensor | None, scatter: str | None, group: str
) -> torch.Tensor:
    """A rowwise layer's output from its partial product: summed over TP (or, for the
    module named ``scatter`` under sequence parallelism, reduce-scattered along the
    sequence, the bias's gradient summed over TP), then the bias added."""
    if scatter is None:
        out = tp_reduce(partial, group)
    else:
        out = tp_reduce_scatter(check_stream(partial, f"the output of {scatter}", 1), 1, group)
        bias = None if bias is None else tp_copy(bias, group)
    return out if bias is None else out + bias


def _linear_rowwise(style: Style, group: str, scatter: str | None) -> Forward:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if style.split_input:
            x = tp_split(x, -1, group)
        return _rowwise_sum(F.linear(x, self.weight), self.bias, scatter, group)

    return forward


def _conv1d_rowwise(style: Style, group: str, scatter: str | None) -> Forward:
    def forward(self: _Conv1D, x: torch.Tensor) -> torch.Tensor:
        if style.split_input:
            x = tp_split(x, -1, group)
        weight: torch.Tensor = self.weight
        shape = (*x.shape[:-1], weight.shape[1])
        partial = torch.mm(x.reshape(-1, x.size(-1)), weight).view(shape)
        return _rowwise_sum(partial, self.bias, scatter, group)

    return forward


def _embedding_rowwise(rank: int, group: str, own: Forward) -> Forward:
    """The vocabulary-split lookup around the module's own forward ``own`` (bound), so a
    subclass's work on the looked-up rows stays: Gemma's embedding scales them by
    sqrt(hidden). Each output position depends on its own id only, so the rank holding an
    id's row computes that position and the others' zeros sum it over TP."""

    def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        lo = rank * rows
        outside = (ids < lo) | (ids >= lo + rows)
        local = (ids - lo).masked_fill(outside, 0)
        pad = self.padding_idx  # the whole vocabulary's index (initialisers read it)
        self.padding_idx = pad - lo if pad is not None and lo <= pad < lo + rows else None
        try:
            out = own(local)
        finally:
            self.padding_idx = pad
        return tp_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0), group)

    return forward


def _new_forward(
    module: nn.Module, style: Style, rank: int, group: str, scatter: str | None
) -> Forward | None:
    if isinstance(module, nn.Embedding):
        if style.kind != "embedding_rowwise":
            return None
        return _embedding_rowwise(rank, group, module.forward)
    conv1d = not isinstance(module, nn.Linear)
    if style.kind == "colwise":
        return (_conv1d_colwise if conv1d else _linear_colwise)(style, group)
    return (_conv1d_rowwise if conv1d else _linear_rowwise)(style, group, scatter)


def apply_layout(module: nn.Module, layout: TPLayout, rank: int, group: str) -> None:
    """Make ``module`` TP rank ``rank``'s share of itself, in place (see the module docs)."""
    params = dict(module.named_parameters())
    for name, shard in layout.shards.items():
        _local_param(params[name], shard, rank)
    sequence = layout.sequence
    for name, style in layout.modules.items():
        mod = module.get_submodule(name)
        scatter = name if sequence is not None and name in sequence.scattered else None
        forward = _new_forward(mod, style, rank, group, scatter)
        if forward is not None:
            mod.forward = types.MethodType(forward, mod)
    for name, names in layout.summed.items():
        mod = module.get_submodule(name)
        mod.forward = summing_grads(mod, mod.forward, names, group)
    for _, mod, attr, value in _head_counts(module, layout.modules):
        setattr(mod, attr, value // layout.size)
    if sequence is not None:
        apply_sequence(module, sequence, layout.size, group)
    use_vocab_parallel_loss(module, layout.modules, group)
