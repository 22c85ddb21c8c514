"""Peak memory per rank of starting from a Hugging Face checkpoint, by construction path.

Issue 24: a model larger than one host must never exist whole on a rank. A
Llama of ``--layers`` layers (default 18: 1024 MiB of fp32 parameters) is saved
once as sharded safetensors; then, at pp=2 x dp=2 with ZeRO-3, each path builds
it, loads the checkpoint and runs one training step (SGD without momentum: no
optimizer state, so what remains is weights and gradients):

* ``meta``: ``mpar.DistributedModel(factory)`` (built on the meta device),
  ``mpar.load_pretrained`` (each rank reads only its shard's elements);
* ``whole``: today's path, ``from_pretrained`` on every rank, then
  ``mpar.DistributedModel``;
* ``fsdp2`` (``--paths fsdp2``): torch FSDP2 over the 4 ranks (no pipeline):
  meta build, ``fully_shard`` per decoder layer, ``to_empty``, rotary buffer
  recomputed, ``dcp.load`` with ``HuggingFaceStorageReader``.

Each rank reports its peak resident set from process start (``ru_maxrss``:
anonymous and file pages, memory-mapped checkpoint pages included) at three
points: after imports and ``mpar.init`` (the baseline), after the model and
checkpoint are loaded (the model is partitioned at construction from
``example_kwargs``, so this includes profiling, splitting, materializing and
reading), and after the first step; and ``RssAnon``/``RssFile`` at the end::

    python benchmarks/large_model_memory.py            # writes results/large_model_memory.json
    python benchmarks/large_model_memory.py --paths fsdp2 --name large_model_memory_fsdp2

A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpar.testing import run_distributed

MIB = 2**20
LABELS = {
    "meta": "mpar meta + load_pretrained",
    "whole": "from_pretrained on every rank + mpar",
    "fsdp2": "FSDP2 dp=4, meta + HF DCP reader",
}
CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 2, "zero": {"stage": 3}}


def _llama_config(layers: int) -> Any:
    import transformers as hf

    return hf.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        use_cache=False,
    )


def _return_freed_memory() -> None:
    """glibc: blocks of 64 KiB and more are mmapped and go back to the system when freed
    (``MALLOC_MMAP_THRESHOLD_=65536``, as the other benchmarks run), so RSS follows what
    is held rather than what the allocator keeps."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _rank(path: str, checkpoint: str, layers: int) -> dict[str, Any]:
    import torch
    import transformers as hf

    import mpar

    _return_freed_memory()
    mpar.init(CONFIG)
    points = {"baseline": _peak()}
    start = time.perf_counter()
    ids = torch.randint(0, 32000, (4, 32), generator=torch.Generator().manual_seed(0))
    if path == "meta":
        factory = lambda: hf.LlamaForCausalLM(_llama_config(layers))  # noqa: E731
        model = mpar.DistributedModel(factory)
        mpar.load_pretrained(model, checkpoint)  # applied when the first step partitions
    else:
        net = hf.LlamaForCausalLM.from_pretrained(checkpoint)
        net.train()
        model = mpar.DistributedModel(net)
        del net
    points["built"] = _peak()
    # After partitioning (profile, split, materialize) and loading, inside the first step.
    model.after_partition.append(lambda m: points.__setitem__("loaded", _peak()))
    opt = mpar.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @mpar.step
    def train(m: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = m(input_ids=ids, labels=ids).loss
        m.backward(loss)
        return loss

    replica = ids[2 * mpar.dp_rank() : 2 * mpar.dp_rank() + 2]  # 2 microbatches of 1
    loss = float(train(model, replica).reduce_mean())
    opt.step()
    points["first_step"] = _peak()
    return {
        "peak_bytes": points,
        "end": _status(),
        "loss": loss,
        "seconds": time.perf_counter() - start,
    }


def _fsdp2_rank(checkpoint: str, layers: int) -> dict[str, Any]:
    """FSDP2 over 4 ranks (no pipeline): meta build, fully_shard, to_empty, torch's
    Hugging Face DCP reader, the rotary buffer recomputed, one step."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers as hf
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.fsdp import fully_shard

    _return_freed_memory()
    dist.init_process_group("gloo")
    points = {"baseline": _peak()}
    start = time.perf_counter()
    with torch.device("meta"):
        net = hf.LlamaForCausalLM(_llama_config(layers))
    for layer in net.model.layers:
        fully_shard(layer)
    fully_shard(net)
    points["built"] = _peak()
    net.to_empty(device="cpu")
    with torch.no_grad():
        net._init_weights(net.model.rotary_emb)  # inv_freq: not in any checkpoint
    state = net.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(checkpoint))
    points["loaded"] = _peak()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    ids = torch.randint(0, 32000, (2, 32), generator=torch.Generator().manual_seed(0))
    part = ids[dist.get_rank() % 2 :][:1]  # one sample per rank, as mpar's replicas get
    loss = net(input_ids=part, labels=part).loss
    loss.backward()
    opt.step()
    points["first_step"] = _peak()
    dist.destroy_process_group()
    return {
        "peak_bytes": points,
        "end": _status(),
        "loss": float(loss),
        "seconds": time.perf_counter() - start,
    }


def _save_checkpoint(root: Path, layers: int) -> int:
    import torch
    import transformers as hf

    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(_llama_config(layers))
    model.save_pretrained(root, max_shard_size="300MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--paths", default="meta,whole,fsdp2")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="large_model_memory", help="result file name")
    args = parser.parse_args()
    results: dict[str, Any] = {"layout": "pp=2 x dp=2, ZeRO-3, fp32, SGD", "layers": args.layers}
    with tempfile.TemporaryDirectory(prefix="mpar-large-") as tmp:
        results["model_bytes"] = _save_checkpoint(Path(tmp), args.layers)
        for path in args.paths.split(","):
            if path == "fsdp2":
                ranks = run_distributed(_fsdp2_rank, 4, args=(tmp, args.layers), timeout=1800)
            else:
                ranks = run_distributed(_rank, 4, args=(path, tmp, args.layers), timeout=1800)
            results[path] = ranks
    out = Path(args.out) / f"{args.name}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"model: {results['model_bytes'] / MIB:.0f} MiB of fp32 parameters; {results['layout']}")
    print(
        "| path | rank | after init | after build | after load | after first step "
        "| first step - init | RssAnon / RssFile at end |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for path in args.paths.split(","):
        for rank, r in enumerate(results[path]):
            p, e = {k: v / MIB for k, v in r["peak_bytes"].items()}, r["end"]
            print(
                f"| {LABELS.get(path, path)} | {rank} | {p['baseline']:.0f} | {p['built']:.0f} "
                f"| {p['loaded']:.0f} | {p['first_step']:.0f} | {p['first_step'] - p['baseline']:.0f} "
                f"| {e['RssAnon'] / MIB:.0f} / {e['RssFile'] / MIB:.0f} |"
            )


if __name__ == "__main__":
    main()
