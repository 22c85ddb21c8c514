"""What the GPU check looks at besides speed: host synchronizations, the attention kernel
that ran, the CUDA streams that kernels and copies used, and a pp=2 stage pair on one GPU.

Each probe is a function of the check's child processes (``check.py --part ...``); none
runs in the main suite except through ``check.py --cpu``, where the CUDA-only parts
report ``None``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["count_syncs", "kernel_summary", "pp2_stage_pair", "profile_step"]

ATTENTION_KERNELS = {
    "flash": re.compile(r"flash", re.I),
    "efficient": re.compile(r"(efficient|fmha|cutlass.*attention|mem_eff)", re.I),
    "cudnn": re.compile(r"cudnn.*(sdpa|attention|fprop)|sdpa", re.I),
    "math": re.compile(r"^aten::_scaled_dot_product_attention_math", re.I),
}
"""Kernel-name patterns of the scaled-dot-product attention backends."""


@contextlib.contextmanager
def count_syncs(device: str) -> Iterator[dict[str, Any]]:
    """Count the host synchronizations inside the block: ``torch.cuda``'s sync debug
    mode (each synchronizing CUDA call warns) and mpar's own ledger
    (``mpar._device.SYNCS``, by reason). On the CPU only the ledger counts."""
    import torch

    from mpar import _device

    found: dict[str, Any] = {}
    _device.SYNCS.take()
    cuda = device == "cuda" and torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            inside = list(caught)  # before the mode is reset (which may warn itself)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in inside if _is_sync(str(w.message))]
    found["cuda_sync_warnings"] = len(syncs) if cuda else None
    found["cuda_sync_sites"] = [_where(w) for w in syncs]
    found["ledger"] = _device.SYNCS.take()


NOTICE = "Synchronization debug mode is a prototype feature"
"""The start of the notice torch gives once per process when the debug mode is first
set (``torch._C._cuda_set_sync_debug_mode``): not a synchronisation. Counted as one
before 2026-11-28, it was the "one sync a step the ledger does not name" of the first
GPU runs, placed at ``torch/cuda/__init__.py`` (``set_sync_debug_mode``)."""


def _is_sync(message: str) -> bool:
    """Whether a warning caught under the sync debug mode reports a synchronisation."""
    return "synchroniz" in message.lower() and not message.startswith(NOTICE)


def _where(w: warnings.WarningMessage) -> str:
    return f"{Path(w.filename).name}:{w.lineno}"


def profile_step(run: Callable[[], None], out: Path | None, name: str) -> dict[str, Any]:
    """One call of ``run`` under ``torch.profiler`` (CPU and CUDA activities): the
    kernels it launched, by stream, and the attention backend. The Chrome trace is
    written gzipped to ``out/name.json.gz`` when ``out`` is given."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    trace = Path(f"/tmp/{name}-{os.getpid()}.json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with gzip.open(out / f"{name}.json.gz", "wt") as f:
            json.dump(events, f)
    trace.unlink()
    return kernel_summary(events.get("traceEvents", []))


def kernel_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From Chrome-trace events: kernels and copies per stream, the attention backend
    that ran, and how long kernels on different streams ran at the same time."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    per_stream: Counter[str] = Counter()
    for e in gpu:
        per_stream[str(e.get("args", {}).get("stream", e.get("tid")))] += 1
    names = [str(e.get("name", "")) for e in events if e.get("ph") == "X"]
    backends = {
        kind: sum(1 for n in names if pattern.search(n))
        for kind, pattern in ATTENTION_KERNELS.items()
    }
    return {
        "gpu_events": len(gpu),
        "streams": dict(per_stream),
        "attention": backends,
        "attention_backend": _backend(backends),
        "overlap_us": _overlap_us(gpu),
        "top_kernels": Counter(str(e.get("name", ""))[:80] for e in gpu).most_common(12),
    }


def _backend(counts: dict[str, int]) -> str | None:
    for kind in ("flash", "cudnn", "efficient", "math"):
        if counts.get(kind):
            return kind
    return None


def _overlap_us(gpu: list[dict[str, Any]]) -> float:
    """Microseconds during which GPU work on two or more streams ran at once."""
    edges: list[tuple[float, int, str]] = []
    for e in gpu:
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        start, dur = float(e.get("ts", 0)), float(e.get("dur", 0))
        edges += [(start, 1, stream), (start + dur, -1, stream)]
    edges.sort(key=lambda t: (t[0], t[1]))
    active: Counter[str] = Counter()
    total, last = 0.0, None
    for ts, delta, stream in edges:
        if last is not None and sum(1 for v in active.values() if v > 0) >= 2:
            total += ts - last
        active[stream] += delta
        last = ts
    return total


def pp2_stage_pair(steps: int, microbatches: int) -> dict[str, Any]:
    """Rank body (2 ranks on one GPU, gloo host-staged): a bf16 GPT at pp=2 with 1F1B;
    the host synchronizations of one steady-state step and the attention backend."""
    import torch

    import mpar
    from mpar.testing.models import GPTConfig, TinyGPT

    mpar.init(
        {
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "backend": "gloo",
            "bf16": torch.cuda.is_available(),
            "pipeline_parallel_degree": 2,
            "microbatches": microbatches,
        }
    )
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, d_model=256, num_layers=4, num_heads=4, d_ffn=1024,
                    max_seq_len=128)  # fmt: skip
    model = mpar.DistributedModel(TinyGPT(cfg))
    opt = mpar.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @mpar.step
    def train(m: Any, x: Any, y: Any) -> Any:
        logits = m(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        m.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (2 * microbatches, 129), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    device = str(mpar.config().device)
    result: dict[str, Any] = {"rank": mpar.pp_rank()}
    for s in range(steps):
        probe = count_syncs(device) if s == steps - 1 else contextlib.nullcontext({})
        with probe as found:
            out = train(model, x, y)
            opt.step()
            opt.zero_grad()
        result["syncs"] = found
    result["loss"] = float(out.reduce_mean())
    result["memory"] = mpar.memory_report()
    mpar.shutdown()
    return result


def gpt(size: str = "sanity") -> tuple[Any, Any]:
    """``mpar plan --model benchmarks.gpu.probes:gpt`` factory: the check's GPT of
    ``size`` and one microbatch of its token ids (the 1B one: ``probes:gpt_1b``)."""
    import torch

    from mpar.testing.models import GPTConfig, TinyGPT

    sizes = {
        "1b": (
            dict(vocab_size=32768, d_model=2048, num_layers=18, num_heads=16, d_ffn=8192),
            1024,
            4,
        ),
        "sanity": (
            dict(vocab_size=1024, d_model=256, num_layers=4, num_heads=4, d_ffn=1024),
            128,
            4,
        ),
        "tiny": (dict(vocab_size=128, d_model=32, num_layers=2, num_heads=2, d_ffn=64), 16, 2),
    }
    kwargs, seq, batch = sizes[size]
    model = TinyGPT(GPTConfig(**kwargs, max_seq_len=seq))
    return model, torch.randint(0, kwargs["vocab_size"], (batch, seq))


def gpt_1b() -> tuple[Any, Any]:
    return gpt("1b")


def gpt_tiny() -> tuple[Any, Any]:
    return gpt("tiny")
