"""Sequence parallelism: the norm and dropout regions of the blocks on 1/tp of the tokens.

Megatron-LM's sequence parallelism (SP), on with ``optimize: "memory"`` (smp's meaning)
or any ``"sequence_parallel"`` entry in the plan (Hugging Face's spelling). Without it,
the residual stream between a block's split layers (norms, dropout, residual adds) is
whole on every TP rank. With it, each TP rank keeps its piece of the stream along the
sequence (dim 1, batch-first), so those regions compute, and save for backward, 1/tp of
the tokens, and pipeline stage boundaries carry 1/tp of the activation.

Where the sequence is split and joined, found by :func:`plan_sequence` when the model is
wrapped:

* **Block lists**: the outermost ``nn.ModuleList`` (or ``nn.Sequential`` of one block
  type) whose blocks hold planned modules (``model.layers``, ``transformer.h``, T5's
  ``encoder.block`` and ``decoder.block``). The first block of a list takes this rank's
  piece of its input's sequence (its first argument, or ``hidden_states=``); the output
  of the last block (its first element when a tuple) is all-gathered. What runs before
  the blocks (embeddings, masks, position ids, rotary tables) and after them (final
  norm, head, loss) sees the whole sequence.
* **Gather points**: the parent of the colwise modules inside a block (``self_attn``,
  ``mlp``; the colwise module itself where its parent is the block) all-gathers the
  sequence of its first input. Inside it tensor parallelism runs as without SP, so
  code there that reads the sequence length from a tensor (attention reshapes) sees
  the whole sequence.
* **Rowwise modules** inside a block reduce-scatter their output along the sequence
  instead of all-reducing it; a bias is added to this rank's tokens.

Parameters used between the gather points (norm weights, rowwise biases) see different
tokens on each TP rank: each use goes through ``tp_copy`` (identity forward, gradient
summed over TP), so their gradients are the one-process ones and stay replicated.

What cannot be sequence-split is refused when the model is wrapped: a model without a
block list holding planned modules, and a module between the gather points that mpar
cannot show to work token by token (an unsplit ``nn.Linear``, say, as an attention the
plan leaves whole would be). A sequence length not divisible by the TP degree is refused
at the first step. mpar does not pad.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mpar.comm._tp_ops import tp_copy, tp_gather, tp_split
from mpar.tensor_parallel._tp_plan import Style, TPPlanError

__all__ = [
    "SequenceLayout",
    "SequenceParallelError",
    "apply_sequence",
    "plan_sequence",
    "sequence_parallel_on",
    "summing_grads",
]

_FIX = "or use optimize 'speed' (tensor parallelism without sequence parallelism)"


class SequenceParallelError(TPPlanError):
    """Sequence parallelism cannot apply to this model or this input."""


@dataclass
class SequenceLayout:
    """Where sequence parallelism splits and joins the sequence (module names)."""

    lists: list[list[str]]
    """Each block list's blocks, in order: the first scatters, the last gathers."""
    gathers: list[str]
    """Modules whose first input is all-gathered along the sequence."""
    scattered: frozenset[str]
    """Rowwise modules whose output is reduce-scattered along the sequence."""
    summed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Module -> its own parameters (replicated, used on this rank's tokens) whose
    gradients are summed over TP."""


def sequence_parallel_on(plan: Mapping[str, Style], optimize: str) -> bool:
    """Whether sequence parallelism is on: ``optimize`` is ``"memory"`` (smp's meaning) or
    the plan has a ``"sequence_parallel"`` entry (Hugging Face's spelling)."""
    return optimize == "memory" or any(s.kind == "sequence_parallel" for s in plan.values())


def _is_block_list(module: nn.Module) -> bool:
    children = list(module.children())
    if not children or not all(any(True for _ in c.children()) for c in children):
        return False
    if isinstance(module, nn.ModuleList):
        return True
    return isinstance(module, nn.Sequential) and len({type(c) for c in children}) == 1


def _inside(name: str, prefix: str) -> bool:
    return not prefix or name.startswith(prefix + ".")


def _block_lists(module: nn.Module, planned: list[str]) -> list[list[str]]:
    found: list[tuple[str, list[str]]] = []
    for name, mod in module.named_modules():
        if any(_inside(name, prefix) for prefix, _ in found) or not _is_block_list(mod):
            continue
        blocks = [f"{name}.{c}" if name else c for c, _ in mod.named_children()]
        if any(_inside(p, b) for b in blocks for p in planned):
            found.append((name, blocks))
    return [blocks for _, blocks in found]


def _gather_points(module: nn.Module, styles: dict[str, Style], blocks: list[str]) -> list[str]:
    points = set()
    for name, style in styles.items():
        block = next((b for b in blocks if _inside(name, b)), None)
        if style.kind != "colwise" or block is None:
            continue
        if isinstance(module.get_submodule(name), nn.Embedding):
            continue  # its input is ids or positions, not the stream
        parent = name.rpartition(".")[0]
        points.add(name if parent == block else parent)
    return sorted(p for p in points if not any(_inside(p, q) for q in points if q != p))


def _tokenwise(module: nn.Module, params: list[torch.Tensor]) -> bool:
    """Whether ``module`` (holding ``params`` itself) is known to work token by token."""
    kind = type(module).__name__
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or kind.endswith(("LayerNorm", "RMSNorm")):
        return True
    builtin = type(module).__module__.startswith("torch.")  # Linear, Conv, BatchNorm, ...
    return not builtin and all(p.dim() <= 1 for p in params)  # a learned scale or offset


def _summed_params(
    module: nn.Module,
    styles: dict[str, Style],
    split: set[str],
    block: str,
    gathers: list[str],
    tp: int,
) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, mod in module.get_submodule(block).named_modules(prefix=block):
        if any(name == g or _inside(name, g) for g in gathers):
            continue
        own = list(mod.named_parameters(recurse=False))
        style = styles.get(name)
        if not own or (style is not None and style.kind == "rowwise"):
            continue  # a rowwise module sums its bias's gradient itself
        if style is None and not _tokenwise(mod, [p for _, p in own]):
            raise SequenceParallelError(
                f"sequence parallelism: module {name} ({type(mod).__name__}) in block {block} "
                f"would run on 1/{tp} of the sequence, but mpar splits the sequence only "
                "through norms, dropout, element-wise scales and the plan's split modules "
                "(an unsplit nn.Linear may be part of an attention that needs every token); "
                f"split it in tp_plan (colwise/rowwise), {_FIX}"
            )
        names = tuple(n for n, _ in own if f"{name}.{n}" not in split)
        if names:
            out[name] = names
    return out


def plan_sequence(
    module: nn.Module, styles: dict[str, Style], split: set[str], tp: int
) -> SequenceLayout:
    """Where SP splits ``module``'s sequence (``styles``: its split modules' styles;
    ``split``: its split parameters' names); raises :class:`SequenceParallelError`
    naming the module when SP cannot apply."""
    lists = _block_lists(module, list(styles))
    if not lists:
        raise SequenceParallelError(
            f"sequence parallelism (optimize 'memory', or a 'sequence_parallel' plan entry) "
            f"splits the sequence between repeated blocks, but {type(module).__name__} has no "
            "nn.ModuleList of blocks holding the plan's split modules (planned: "
            f"{sorted(styles)[:4]}); {_FIX}"
        )
    blocks = [b for bl in lists for b in bl]
    gathers = _gather_points(module, styles, blocks)
    scattered = frozenset(
        n for n, s in styles.items() if s.kind == "rowwise" and any(_inside(n, b) for b in blocks)
    )
    layout = SequenceLayout(lists, gathers, scattered)
    for block in blocks:
        layout.summed.update(_summed_params(module, styles, split, block, gathers, tp))
    return layout


# -- applying ---------------------------------------------------------------------------


def check_stream(x: object, where: str, tp: int) -> torch.Tensor:
    """``x`` if it is a (batch, sequence, ...) tensor whose sequence splits ``tp`` ways."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise SequenceParallelError(
            f"sequence parallelism: {where} should be a (batch, sequence, features) "
            f"tensor, got {got}; {_FIX}"
        )
    if x.shape[1] % tp:
        raise SequenceParallelError(
            f"sequence parallelism splits the sequence (dim 1) of {where} over "
            f"tensor_parallel_degree {tp}, but its length {x.shape[1]} is not divisible by "
            f"{tp}; pad the inputs to a multiple of {tp} (masking the padding out of the "
            f"loss), {_FIX}"
        )
    return x


Forward = Callable[..., object]
"""A module's ``forward`` (bound), whatever it returns."""


def _on_stream(
    forward: Forward, where: str, change: Callable[[object, str], torch.Tensor]
) -> Forward:
    """``forward`` with its first argument (or ``hidden_states=``) passed through ``change``."""

    def wrapped(*args: object, **kwargs: object) -> object:
        if args:
            args = (change(args[0], f"the first input of {where}"), *args[1:])
        elif "hidden_states" in kwargs:
            kwargs["hidden_states"] = change(kwargs["hidden_states"], f"{where}'s hidden_states")
        else:
            raise SequenceParallelError(
                f"sequence parallelism: {where} was called without positional arguments or "
                f"hidden_states= (got {sorted(kwargs)}); mpar splits or gathers the sequence "
                f"of a block's first input; {_FIX}"
            )
        return forward(*args, **kwargs)

    return wrapped


def _gathering_output(forward: Forward, where: str, group: str) -> Forward:
    def gather(x: object) -> torch.Tensor:
        return tp_gather(check_stream(x, f"the output of {where}", 1), 1, group)

    def wrapped(*args: object, **kwargs: object) -> object:
        out = forward(*args, **kwargs)
        if isinstance(out, (tuple, list)) and type(out) in (tuple, list) and out:
            return type(out)([gather(out[0]), *out[1:]])
        return gather(out)

    return wrapped


def summing_grads(
    module: nn.Module, forward: Forward, names: tuple[str, ...], group: str
) -> Forward:
    """``forward`` with each of ``names`` used through ``tp_copy`` (gradient summed over TP)."""

    def wrapped(*args: object, **kwargs: object) -> object:
        store: dict[str, nn.Parameter | None] = module._parameters
        saved = {n: store[n] for n in names}
        try:
            for n, p in saved.items():
                if p is not None:
                    store[n] = tp_copy(p, group)
            return forward(*args, **kwargs)
        finally:
            store.update(saved)

    return wrapped


def apply_sequence(module: nn.Module, layout: SequenceLayout, tp: int, group: str) -> None:
    """Install SP's splits and joins in ``module``'s forwards, in place (see the module docs;
    the rowwise modules' reduce-scatter is in their own forward)."""
    wrapped: set[int] = set()  # a module shared by several blocks is wrapped once
    for name, names in layout.summed.items():
        mod = module.get_submodule(name)
        if id(mod) not in wrapped:
            wrapped.add(id(mod))
            mod.forward = summing_grads(mod, mod.forward, names, group)
    for name in layout.gathers:
        mod = module.get_submodule(name)
        mod.forward = _on_stream(
            mod.forward, name, lambda x, where: tp_gather(check_stream(x, where, 1), 1, group)
        )
    for blocks in layout.lists:
        first, last = module.get_submodule(blocks[0]), module.get_submodule(blocks[-1])
        first.forward = _on_stream(
            first.forward,
            blocks[0],
            lambda x, where: tp_split(check_stream(x, where, tp), 1, group),
        )
        last.forward = _gathering_output(last.forward, blocks[-1], group)
