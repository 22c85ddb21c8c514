"""What each rank saves, and where each rank loads: the checkpoint's state dict.

The state dict handed to DCP, the same on every layout::

    {"model": {key: tensor},                       # the original module's state-dict keys
     "optim": {"state": {fqn: {"exp_avg": tensor, "step": tensor, ...}},
               "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...]},
     "mpar": {"extras": bytes}}                    # torch.save of user_content, loss scale

which is torch.distributed.checkpoint.state_dict's format (optimizer state keyed
by parameter name). Each rank lists only what it owns: a ZeRO-sharded parameter
(and its element-wise optimizer state) as :class:`Pieces` of this rank's slice
of the fp32 master values; replicated tensors whole (DCP's planner keeps one
writer for entries several ranks list). Parameters held by another pipeline
rank are that rank's to list. At load each rank asks for the same pieces of
the new layout and DCP reads the overlapping saved chunks.

The model, its sharded stages and its optimizer are read through their public
accessors (:meth:`DistributedModel.local_tensors`, :attr:`DistributedModel.state_keys`,
:meth:`ShardedStages.master_runs`, :attr:`ShardedOptimizer.segments`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import torch

from mpar._compat import Metadata, TensorStorageMetadata
from mpar.checkpoint._dcp import LocalSplit, Pieces
from mpar.runtime import DistributedModel, DistributedOptimizer
from mpar.shard import ShardedOptimizer

__all__ = [
    "Entry",
    "Install",
    "OptimSection",
    "Sections",
    "load_model_targets",
    "load_optimizer_targets",
    "merge_param_groups",
    "model_entries",
    "optimizer_entries",
    "publish_masters",
]

Copy = Callable[[torch.Tensor], torch.Tensor]
"""How a saved tensor is taken: itself (a synchronous save) or a CPU copy (async)."""
Entry = torch.Tensor | Pieces
"""A model entry: this rank's whole tensor, or its pieces of a sharded or split one."""
ParamState = dict[str, object]
"""One parameter's optimizer state: tensors, :class:`Pieces`, or plain values (``step``)."""
Groups = list[dict[str, object]]
"""``param_groups``: each group's options, with ``params`` (names or indices)."""


class OptimSection(TypedDict):
    """The ``"optim"`` section, keyed by parameter name (fqn)."""

    state: dict[str, ParamState]
    param_groups: Groups


class Sections(TypedDict, total=False):
    """The state dict DCP saves and loads."""

    model: dict[str, Entry]
    optim: OptimSection
    mpar: dict[str, bytes | None]
    """``{"extras": torch.save of user_content and the loss scaler}`` (rank 0 saves it)."""


Install = Callable[[OptimSection], None]
"""Hands the optimizer its state once DCP has filled the targets (the loaded section)."""
Saved = dict[str, dict[str, TensorStorageMetadata | None]]
"""The optimizer state a checkpoint holds: fqn -> key -> its tensor metadata (None for
a non-tensor value such as a Python number)."""


def _same(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _pieces(model: DistributedModel, key: str, shape: torch.Size, dtype: torch.dtype) -> Pieces:
    """Empty pieces of the tensor under ``key``, of which this rank holds runs of
    ``shape`` elements: the whole tensor, or its tensor-parallel piece."""
    shard = model.tp_shard_of(key)
    if shard is None:
        return Pieces(shape, dtype)
    full = torch.Size(model.state_keys.shapes[key])
    return Pieces(full, dtype, LocalSplit(full, shard, model.grid.tp_rank))


def _split_whole(model: DistributedModel, key: str, tensor: torch.Tensor) -> Entry:
    """``tensor`` as it goes into the checkpoint: itself, or (a tensor-parallel piece)
    :class:`Pieces` over all of it."""
    if model.tp_shard_of(key) is None:
        return tensor
    pieces = _pieces(model, key, tensor.shape, tensor.dtype)
    pieces.add_run(tensor.view(-1), 0, tensor.numel())
    pieces.local = tensor
    return pieces


def _keys_by_tensor(local: Mapping[str, torch.Tensor]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for key, tensor in local.items():
        out.setdefault(id(tensor), []).append(key)
    return out


def _master_pieces(model: DistributedModel, copy: Copy) -> dict[str, Pieces]:
    """The bucketed parameters' entries: pieces of this rank's master values."""
    assert model.sharded is not None
    keys = _keys_by_tensor(model.local_tensors())
    out: dict[str, Pieces] = {}
    copies: dict[int, torch.Tensor] = {}
    for run in model.sharded.master_runs():
        if id(run.master) not in copies:  # one copy of each bucket's master values
            copies[id(run.master)] = copy(run.master)
        values = copies[id(run.master)][run.offset : run.offset + run.stop - run.start]
        for key in keys.get(id(run.param), []):
            pieces = out.setdefault(key, _pieces(model, key, run.shape, run.master.dtype))
            pieces.add_run(values, run.start, run.stop)
    return out


def _entries(model: DistributedModel, copy: Copy, cast: bool) -> dict[str, Entry]:
    """This rank's share of the model state: pieces of the master values for bucketed
    parameters, the other tensors whole (``cast``: in their original dtypes)."""
    if model.stages is None:  # not partitioned: every rank holds the whole module
        return {k: copy(v) for k, v in model.module.state_dict().items()}
    out: dict[str, Entry] = {}
    bucketed: set[int] = set()
    if model.sharded is not None:
        out.update(_master_pieces(model, copy))
        bucketed = {id(p) for p in model.sharded.params}
    for key, tensor in model.local_tensors().items():
        if id(tensor) in bucketed:
            continue
        value = copy(tensor)
        if cast:
            value = value.to(model.state_keys.dtypes[key]).contiguous()
        out[key] = _split_whole(model, key, value)
    return out


def model_entries(model: DistributedModel, copy: Copy = _same) -> dict[str, Entry]:
    """This rank's share of the model state (original keys, original dtypes)."""
    return _entries(model, copy, cast=True)


def _elementwise(value: object, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _param_groups(
    optimizer: DistributedOptimizer, names: Mapping[int, str], source: torch.optim.Optimizer
) -> Groups:
    """Options of ``source``'s groups, with the names of ``optimizer``'s parameters."""
    groups: Groups = []
    for group, options in zip(optimizer.param_groups, source.param_groups):
        kept = {k: v for k, v in options.items() if k != "params"}
        groups.append({**kept, "params": [names[id(p)] for p in group["params"]]})
    return groups


def _sharded_state(
    so: ShardedOptimizer, model: DistributedModel, names: Mapping[int, str], copy: Copy
) -> dict[str, ParamState]:
    out: dict[str, ParamState] = {}
    for sp in so.segments:
        state = so.state.get(sp.param) or {}
        staged = {k: copy(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for run in sp.runs:
            fqn = names[id(run.param)]
            entry = out.setdefault(fqn, {})
            for key, value in staged.items():
                if isinstance(value, torch.Tensor) and _elementwise(value, sp.segment.numel):
                    pieces = entry.setdefault(key, _pieces(model, fqn, run.shape, value.dtype))
                    assert isinstance(pieces, Pieces)
                    length = run.stop - run.start
                    pieces.add_run(value[run.offset : run.offset + length], run.start, run.stop)
                else:
                    entry.setdefault(key, value)
    return out


def _plain_state(
    optimizer: DistributedOptimizer, model: DistributedModel, names: Mapping[int, str], copy: Copy
) -> dict[str, ParamState]:
    out: dict[str, ParamState] = {}
    for param in model.local_parameters():
        state = optimizer.optimizer.state.get(param)
        if not state:
            continue
        fqn = names[id(param)]
        entry: ParamState = {}
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.shape == param.shape and v.dim() > 0:
                entry[k] = _split_whole(model, fqn, copy(v).contiguous())
            else:
                entry[k] = copy(v) if isinstance(v, torch.Tensor) else v
        out[fqn] = entry
    return out


def _pending_entries(
    optimizer: DistributedOptimizer,
    names: Mapping[int, str],
    pending: Mapping[str, Any],
    copy: Copy,
) -> OptimSection:
    """The torch-format state an unpartitioned optimizer holds for later, by name."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_state, saved_groups = pending["state"], pending["param_groups"]
    state = {
        names[id(params[int(i)])]: {k: copy(v) if torch.is_tensor(v) else v for k, v in e.items()}
        for i, e in saved_state.items()
    }
    groups: Groups = []
    for group, saved in zip(optimizer.param_groups, saved_groups):
        options = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**options, "params": [names[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups}


def optimizer_entries(
    optimizer: DistributedOptimizer, model: DistributedModel, copy: Copy = _same
) -> OptimSection:
    """This rank's share of the optimizer state, keyed by parameter name."""
    names = model.param_names()
    so = optimizer.sharded_optimizer()
    pending = optimizer.pending_state
    if pending is not None:  # a full state loaded before partitioning, not applied yet
        return _pending_entries(optimizer, names, pending, copy)
    if so is not None:
        state = _sharded_state(so, model, names, copy)
        groups = _param_groups(optimizer, names, so.inner)
    else:
        state = _plain_state(optimizer, model, names, copy)
        groups = _param_groups(optimizer, names, optimizer.optimizer)
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------- load
def load_model_targets(model: DistributedModel) -> dict[str, Entry]:
    """Where this rank's share of the model state goes (views of its storage)."""
    if model.stages is None:
        return dict(model.module.state_dict())
    return _entries(model, _same, cast=False)


def publish_masters(model: DistributedModel) -> None:
    """After the master values were loaded: round them into the parameters, and
    all-gather them where the stage keeps full parameters (collective over dp)."""
    if model.stages is not None and model.sharded is not None:
        model.sharded.publish_masters()


def _saved_state_entries(metadata: Metadata) -> Saved:
    """``fqn -> {key: tensor metadata}`` of the optimizer state in a checkpoint."""
    out: Saved = {}
    for flat, path in (metadata.planner_data or {}).items():
        if len(path) == 4 and tuple(path[:2]) == ("optim", "state"):
            md = metadata.state_dict_metadata[flat]
            tensor = md if isinstance(md, TensorStorageMetadata) else None
            out.setdefault(str(path[2]), {})[str(path[3])] = tensor
    return out


def _target_like(md: TensorStorageMetadata | None, device: torch.device | str = "cpu") -> object:
    """An empty destination for one saved entry (None for a non-tensor one)."""
    if md is None:
        return None
    return torch.empty(md.size, dtype=md.properties.dtype, device=device)


def _is_elementwise_md(key: str, md: TensorStorageMetadata | None, shape: torch.Size) -> bool:
    if md is None or torch.Size(md.size) != shape:
        return False
    return not (len(shape) == 0 and key == "step")


def load_optimizer_targets(
    optimizer: DistributedOptimizer, model: DistributedModel, metadata: Metadata
) -> tuple[dict[str, ParamState], Install]:
    """Destinations of this rank's optimizer state, and the function that installs
    them once DCP has filled them (it gets the loaded ``"optim"`` section)."""
    saved = _saved_state_entries(metadata)
    names = model.param_names()
    so = optimizer.sharded_optimizer()
    if so is not None:
        return _sharded_targets(so, model, names, saved, optimizer)
    return _plain_targets(optimizer, model, names, saved)


SegmentTargets = dict[str, torch.Tensor | tuple[str, str]]
"""One flat optimizer parameter's state to be: key -> its flat buffer (element-wise
state, filled by DCP) or ``(fqn, key)`` of a value resolved after the load."""


def _sharded_targets(
    so: ShardedOptimizer,
    model: DistributedModel,
    names: Mapping[int, str],
    saved: Saved,
    optimizer: DistributedOptimizer,
) -> tuple[dict[str, ParamState], Install]:
    targets: dict[str, ParamState] = {}
    per_segment: list[SegmentTargets] = []
    for sp in so.segments:
        seg: SegmentTargets = {}
        for run in sp.runs:
            fqn = names[id(run.param)]
            entry = targets.setdefault(fqn, {})
            full_shape = torch.Size(model.state_keys.shapes.get(fqn, run.shape))
            for key, md in saved.get(fqn, {}).items():
                if md is not None and _is_elementwise_md(key, md, full_shape):
                    dtype = md.properties.dtype
                    flat = seg.setdefault(
                        key, torch.empty(sp.segment.numel, dtype=dtype, device=sp.param.device)
                    )
                    assert isinstance(flat, torch.Tensor)
                    pieces = entry.setdefault(key, _pieces(model, fqn, run.shape, dtype))
                    assert isinstance(pieces, Pieces)
                    length = run.stop - run.start
                    pieces.add_run(flat[run.offset : run.offset + length], run.start, run.stop)
                else:
                    entry.setdefault(key, _target_like(md))
                    seg.setdefault(key, (fqn, key))  # resolved after the load
        per_segment.append(seg)
    return targets, functools.partial(_install_sharded, so, optimizer, names, per_segment)


def _install_sharded(
    so: ShardedOptimizer,
    optimizer: DistributedOptimizer,
    names: Mapping[int, str],
    per_segment: list[SegmentTargets],
    loaded: OptimSection,
) -> None:
    """Give the rebuilt optimizer its segments' state (``loaded``: the optim section)."""
    state = loaded["state"]
    states = {}
    for i, seg in enumerate(per_segment):
        resolved = {
            k: _copy_value(state[v[0]][v[1]]) if isinstance(v, tuple) else v for k, v in seg.items()
        }
        if resolved:
            states[i] = resolved
    so.load_segment_states(states, _check_groups(optimizer, names, loaded["param_groups"]))


def _copy_value(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _plain_targets(
    optimizer: DistributedOptimizer,
    model: DistributedModel,
    names: Mapping[int, str],
    saved: Saved,
) -> tuple[dict[str, ParamState], Install]:
    targets: dict[str, ParamState] = {}
    for param in model.local_parameters():
        fqn = names[id(param)]
        if fqn in saved:
            full_shape = torch.Size(model.state_keys.shapes.get(fqn, param.shape))
            entry: ParamState = {}
            for k, md in saved[fqn].items():
                # element-wise state beside the parameter; ``step`` and the like on the CPU
                if md is not None and _is_elementwise_md(k, md, full_shape):
                    dtype = md.properties.dtype
                    local = torch.empty(param.shape, dtype=dtype, device=param.device)
                    entry[k] = _split_whole(model, fqn, local)
                else:
                    entry[k] = _target_like(md, "cpu")
            targets[fqn] = entry
    return targets, functools.partial(_install_plain, optimizer, model, names, list(targets))


def _install_plain(
    optimizer: DistributedOptimizer,
    model: DistributedModel,
    names: Mapping[int, str],
    fqns: list[str],
    loaded: OptimSection,
) -> None:
    groups = _check_groups(optimizer, names, loaded["param_groups"])
    loaded_state = loaded["state"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    by_name = {names[id(p)]: index[id(p)] for p in model.local_parameters() if id(p) in index}
    state = {
        by_name[f]: {k: _unwrapped(v) for k, v in loaded_state[f].items()}
        for f in fqns
        if f in by_name
    }
    start, full_groups = 0, []
    for options, group in zip(groups, optimizer.param_groups):
        size = len(group["params"])
        full_groups.append({**options, "params": list(range(start, start + size))})
        start += size
    optimizer.optimizer.load_state_dict({"state": state, "param_groups": full_groups})


def _unwrapped(value: object) -> object:
    return value.local if isinstance(value, Pieces) and value.local is not None else value


def _check_groups(
    optimizer: DistributedOptimizer, names: Mapping[int, str], saved: Groups
) -> Groups:
    """The saved groups' options, after checking that each group of ``optimizer``
    names parameters of the same saved group."""
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    found = [set(_names_in(g)) for g in saved]
    if len(current) != len(found) or any(not set(c) <= f for c, f in zip(current, found)):
        raise ValueError(
            f"the checkpoint's optimizer has {len(found)} parameter group(s) of sizes "
            f"{[len(g) for g in found]}, this optimizer {len(current)} of sizes "
            f"{[len(g) for g in current]}, or they name other parameters: build the "
            "optimizer over the same parameters and groups as the one that was saved"
        )
    return [{k: v for k, v in g.items() if k != "params"} for g in saved]


def _names_in(group: Mapping[str, object]) -> list[str]:
    params = group["params"]
    assert isinstance(params, list)
    return [str(p) for p in params]


def merge_param_groups(
    local: list[list[str]], every_rank: list[list[list[str]] | None], order: tuple[str, ...]
) -> list[list[str]]:
    """Each parameter group's names over every rank (an optimizer built after an
    eager partition lists only its rank's parameters), in state-dict ``order``."""
    position = {name: k for k, name in enumerate(order)}
    merged = []
    for i in range(len(local)):
        names = {n for lists in every_rank if lists is not None for n in lists[i]}
        merged.append(sorted(names, key=lambda n: position.get(n, len(position))))
    return merged
