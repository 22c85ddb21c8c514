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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mpar.checkpoint._dcp import LocalSplit, Pieces

__all__ = [
    "load_model_targets",
    "load_optimizer_targets",
    "merge_param_groups",
    "model_entries",
    "optimizer_entries",
    "param_names",
    "publish_masters",
]

Copy = Callable[[torch.Tensor], torch.Tensor]
"""How a saved tensor is taken: itself (a synchronous save) or a CPU copy (async)."""


def _same(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def param_names(model: Any) -> dict[int, str]:
    """``id(parameter) -> name``: the first state-dict key of each parameter (of the
    original module, as wrapped: other ranks' experts included, and of this rank's
    stages)."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    for key, name in model.wrapped_names.items():
        names.setdefault(key, name)
    if model.stages is not None:
        for key, tensor in model._local_tensors().items():
            if isinstance(tensor, nn.Parameter):
                names.setdefault(id(tensor), key)
    return names


def _pieces(model: Any, key: str, shape: torch.Size, dtype: torch.dtype) -> Pieces:
    """Empty pieces of the tensor under ``key``, of which this rank holds runs of
    ``shape`` elements: the whole tensor, or its piece (tensor-parallel, or a fused
    expert weight's rows under expert parallelism)."""
    split = model.split_of(key)
    if split is None:
        return Pieces(shape, dtype)
    full = torch.Size(model._shapes[key])
    return Pieces(full, dtype, LocalSplit(full, *split))


def _split_whole(model: Any, key: str, tensor: torch.Tensor) -> Any:
    """``tensor`` as it goes into the checkpoint: itself, or (a piece) :class:`Pieces`
    over all of it."""
    if model.split_of(key) is None:
        return tensor
    pieces = _pieces(model, key, tensor.shape, tensor.dtype)
    pieces.add_run(tensor.view(-1), 0, tensor.numel())
    pieces.local = tensor
    return pieces


def _keys_by_tensor(local: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for key, tensor in local.items():
        out.setdefault(id(tensor), []).append(key)
    return out


def _bucket_runs(sharded: Any) -> Any:
    """``(bucket, param, shape, (start, stop), (a, b))`` for each run of a parameter in
    this rank's slice of the master values: ``master[a:b]`` holds its flattened
    elements ``[start, stop)``."""
    for bucket in sharded.buckets:
        lo, hi = bucket.opt_range
        for slot, param, shape in zip(bucket.spec.slots, bucket.params, bucket.shapes):
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < stop:
                run = (start - slot.offset, stop - slot.offset)
                yield bucket, param, shape, run, (start - lo, stop - lo)


def _master_pieces(model: Any, keys: dict[int, list[str]], copy: Copy) -> dict[str, Pieces]:
    out: dict[str, Pieces] = {}
    copies: dict[int, torch.Tensor] = {}
    for bucket, param, shape, (start, stop), (a, b) in _bucket_runs(model.sharded):
        if id(bucket) not in copies:
            copies[id(bucket)] = copy(bucket.master)
        for key in keys.get(id(param), []):
            pieces = out.setdefault(key, _pieces(model, key, shape, bucket.master_dtype))
            pieces.add_run(copies[id(bucket)][a:b], start, stop)
    return out


def model_entries(model: Any, copy: Copy = _same) -> dict[str, Any]:
    """This rank's share of the model state (original keys, original dtypes)."""
    if model.stages is None:  # not partitioned: every rank holds the whole module
        return {k: copy(v) for k, v in model.module.state_dict().items()}
    local = model._local_tensors()
    out: dict[str, Any] = {}
    bucketed: set[int] = set()
    if model.sharded is not None:
        out.update(_master_pieces(model, _keys_by_tensor(local), copy))
        bucketed = {id(p) for b in model.sharded.buckets for p in b.params}
    for key, tensor in local.items():
        if id(tensor) in bucketed:
            continue
        value = copy(tensor)
        out[key] = _split_whole(model, key, value.to(model._dtypes[key]).contiguous())
    return out


def _elementwise(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _param_groups(optimizer: Any, names: dict[int, str], source: Any) -> list[dict[str, Any]]:
    """Options of ``source``'s groups, with the names of ``optimizer``'s parameters."""
    groups = []
    for group, options in zip(optimizer.optimizer.param_groups, source.param_groups):
        kept = {k: v for k, v in options.items() if k != "params"}
        groups.append({**kept, "params": [names[id(p)] for p in group["params"]]})
    return groups


def _sharded_state(
    so: Any, model: Any, names: dict[int, str], copy: Copy
) -> dict[str, dict[str, Any]]:
    shapes = {
        slot.index: shape
        for bucket in so.sharded.buckets
        for slot, shape in zip(bucket.spec.slots, bucket.shapes)
    }
    out: dict[str, dict[str, Any]] = {}
    for sp in so.segments:
        state = so.inner.state.get(sp.param) or {}
        staged = {k: copy(v) if torch.is_tensor(v) else v for k, v in state.items()}
        offset = 0
        for piece in sp.segment.pieces:
            param = so.sharded.params[piece.index]
            entry = out.setdefault(names[id(param)], {})
            length = piece.stop - piece.start
            for key, value in staged.items():
                if _elementwise(value, sp.segment.numel):
                    pieces = entry.setdefault(
                        key, _pieces(model, names[id(param)], shapes[piece.index], value.dtype)
                    )
                    pieces.add_run(value[offset : offset + length], piece.start, piece.stop)
                else:
                    entry.setdefault(key, value)
            offset += length
    return out


def _plain_state(optimizer: Any, model: Any, names: dict[int, str], copy: Copy) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for param in model.local_parameters():
        state = optimizer.optimizer.state.get(param)
        if state:
            fqn = names[id(param)]
            out[fqn] = {
                k: _split_whole(model, fqn, copy(v).contiguous())
                if _elementwise_like(v, param)
                else copy(v)
                if torch.is_tensor(v)
                else v
                for k, v in state.items()
            }
    return out


def _elementwise_like(value: Any, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0


def _pending_entries(
    optimizer: Any, names: dict[int, str], pending: dict[str, Any], copy: Copy
) -> dict[str, Any]:
    """The torch-format state an unpartitioned optimizer holds for later, by name."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {
        names[id(params[int(i)])]: {k: copy(v) if torch.is_tensor(v) else v for k, v in e.items()}
        for i, e in pending["state"].items()
    }
    groups = []
    for group, saved in zip(optimizer.param_groups, pending["param_groups"]):
        options = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**options, "params": [names[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups}


def optimizer_entries(optimizer: Any, model: Any, copy: Copy = _same) -> dict[str, Any]:
    """This rank's share of the optimizer state, keyed by parameter name."""
    names = param_names(model)
    so = optimizer.sharded_optimizer()
    pending = getattr(optimizer, "_pending", None)
    if isinstance(pending, dict):  # a full state loaded before partitioning, not applied yet
        return _pending_entries(optimizer, names, pending, copy)
    if so is not None:
        state = _sharded_state(so, model, names, copy)
        groups = _param_groups(optimizer, names, so.inner)
    else:
        state = _plain_state(optimizer, model, names, copy)
        groups = _param_groups(optimizer, names, optimizer.optimizer)
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------- load
def load_model_targets(model: Any) -> dict[str, Any]:
    """Where this rank's share of the model state goes (views of its storage)."""
    if model.stages is None:
        return dict(model.module.state_dict())
    local = model._local_tensors()
    out: dict[str, Any] = {}
    bucketed: set[int] = set()
    if model.sharded is not None:
        out.update(_master_pieces(model, _keys_by_tensor(local), _same))
        bucketed = {id(p) for b in model.sharded.buckets for p in b.params}
    for key, tensor in local.items():
        if id(tensor) not in bucketed:
            out[key] = _split_whole(model, key, tensor.detach())
    return out


def publish_masters(model: Any) -> None:
    """After the master values were loaded: round them into the parameters, and
    all-gather them where the stage keeps full parameters (collective over dp)."""
    if model.stages is None or model.sharded is None:
        return
    works = [bucket.start_publish() for bucket in model.sharded.buckets]
    for work in works:
        if work is not None:
            work.wait()
    model.sharded.synchronize()


def _saved_state_entries(metadata: Any) -> dict[str, dict[str, Any]]:
    """``fqn -> {key: storage metadata}`` of the optimizer state in a checkpoint."""
    out: dict[str, dict[str, Any]] = {}
    for flat, path in (metadata.planner_data or {}).items():
        if len(path) == 4 and tuple(path[:2]) == ("optim", "state"):
            out.setdefault(str(path[2]), {})[str(path[3])] = metadata.state_dict_metadata[flat]
    return out


def _target_like(md: Any, device: torch.device | str = "cpu") -> Any:
    """An empty destination for one saved entry (None for a non-tensor one)."""
    size = getattr(md, "size", None)
    if size is None:
        return None
    return torch.empty(size, dtype=md.properties.dtype, device=device)


def _is_elementwise_md(key: str, md: Any, shape: torch.Size) -> bool:
    size = getattr(md, "size", None)
    if size is None or torch.Size(size) != shape:
        return False
    return not (len(shape) == 0 and key == "step")


def load_optimizer_targets(
    optimizer: Any, model: Any, metadata: Any
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """Destinations of this rank's optimizer state, and the function that installs
    them once DCP has filled them (it gets the loaded ``param_groups`` section)."""
    saved = _saved_state_entries(metadata)
    names = param_names(model)
    so = optimizer.sharded_optimizer()
    if so is not None:
        return _sharded_targets(so, model, names, saved, optimizer)
    return _plain_targets(optimizer, model, names, saved)


def _sharded_targets(
    so: Any, model: Any, names: dict[int, str], saved: dict[str, dict[str, Any]], optimizer: Any
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    shapes = {
        slot.index: shape
        for bucket in so.sharded.buckets
        for slot, shape in zip(bucket.spec.slots, bucket.shapes)
    }
    targets: dict[str, dict[str, Any]] = {}
    per_segment: list[dict[str, Any]] = []
    for sp in so.segments:
        seg: dict[str, Any] = {}
        offset = 0
        for piece in sp.segment.pieces:
            fqn = names[id(so.sharded.params[piece.index])]
            entry = targets.setdefault(fqn, {})
            length = piece.stop - piece.start
            full_shape = torch.Size(model._shapes.get(fqn, shapes[piece.index]))
            for key, md in saved.get(fqn, {}).items():
                if _is_elementwise_md(key, md, full_shape):
                    flat = seg.setdefault(
                        key,
                        torch.empty(
                            sp.segment.numel, dtype=md.properties.dtype, device=sp.param.device
                        ),
                    )
                    pieces = entry.setdefault(
                        key, _pieces(model, fqn, shapes[piece.index], md.properties.dtype)
                    )
                    pieces.add_run(flat[offset : offset + length], piece.start, piece.stop)
                else:
                    entry.setdefault(key, _target_like(md))
                    seg.setdefault(key, (fqn, key))  # resolved after the load
            offset += length
        per_segment.append(seg)

    return targets, functools.partial(_install_sharded, so, optimizer, names, per_segment)


def _install_sharded(
    so: Any, optimizer: Any, names: dict[int, str], per_segment: list[dict[str, Any]], loaded: Any
) -> None:
    """Give the rebuilt optimizer its segments' state (``loaded``: the optim section)."""
    state = {}
    for i, seg in enumerate(per_segment):
        resolved = {
            k: _copy_value(loaded["state"][v[0]][v[1]]) if isinstance(v, tuple) else v
            for k, v in seg.items()
        }
        if resolved:
            state[i] = resolved
    groups = _check_groups(optimizer, names, loaded["param_groups"])
    inner_groups = []
    start = 0
    for options, group in zip(groups, so.inner.param_groups):
        size = len(group["params"])
        inner_groups.append({**options, "params": list(range(start, start + size))})
        start += size
    so.inner.load_state_dict({"state": state, "param_groups": inner_groups})


def _copy_value(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _plain_targets(
    optimizer: Any, model: Any, names: dict[int, str], saved: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    targets: dict[str, dict[str, Any]] = {}
    for param in model.local_parameters():
        fqn = names[id(param)]
        if fqn in saved:
            full_shape = torch.Size(model._shapes.get(fqn, param.shape))
            entry: dict[str, Any] = {}
            for k, md in saved[fqn].items():
                # element-wise state beside the parameter; ``step`` and the like on the CPU
                if _is_elementwise_md(k, md, full_shape):
                    local = torch.empty(param.shape, dtype=md.properties.dtype, device=param.device)
                    entry[k] = _split_whole(model, fqn, local)
                else:
                    entry[k] = _target_like(md, "cpu")
            targets[fqn] = entry
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}

    def install(loaded: dict[str, Any]) -> None:
        groups = _check_groups(optimizer, names, loaded["param_groups"])
        by_name = {names[id(p)]: index[id(p)] for p in model.local_parameters() if id(p) in index}
        state = {
            by_name[f]: {k: _unwrapped(v) for k, v in loaded["state"][f].items()}
            for f in targets
            if f in by_name
        }
        start, full_groups = 0, []
        for options, group in zip(groups, optimizer.param_groups):
            size = len(group["params"])
            full_groups.append({**options, "params": list(range(start, start + size))})
            start += size
        optimizer.optimizer.load_state_dict({"state": state, "param_groups": full_groups})

    return targets, install


def _unwrapped(value: Any) -> Any:
    return value.local if isinstance(value, Pieces) and value.local is not None else value


def _check_groups(
    optimizer: Any, names: dict[int, str], saved: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The saved groups' options, after checking that each group of ``optimizer``
    names parameters of the same saved group."""
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    found = [set(g["params"]) for g in saved]
    if len(current) != len(found) or any(not set(c) <= f for c, f in zip(current, found)):
        raise ValueError(
            f"the checkpoint's optimizer has {len(found)} parameter group(s) of sizes "
            f"{[len(g) for g in found]}, this optimizer {len(current)} of sizes "
            f"{[len(g) for g in current]}, or they name other parameters: build the "
            "optimizer over the same parameters and groups as the one that was saved"
        )
    return [{k: v for k, v in g.items() if k != "params"} for g in saved]


def merge_param_groups(
    local: list[list[str]], every_rank: list[Any], order: list[str]
) -> list[list[str]]:
    """Each parameter group's names over every rank (an optimizer built after an
    eager partition lists only its rank's parameters), in state-dict ``order``."""
    position = {name: k for k, name in enumerate(order)}
    merged = []
    for i in range(len(local)):
        names = {n for lists in every_rank if lists is not None for n in lists[i]}
        merged.append(sorted(names, key=lambda n: position.get(n, len(position))))
    return merged
