"""Calibration of the planner: predicted vs measured peak memory per rank and step time.

For each layout of a grid (pp x dp, ZeRO stage, activation checkpointing) one
``mpar launch`` job trains a ``TinyGPT`` (Adam, fp32, a fixed batch) and every
rank reports:

* **measured peak**: a thread samples the process's anonymous resident memory
  (``/proc/self/statm``: resident less file-backed pages, i.e. without library
  code; the whole RSS is reported beside it) every ``--sample-ms`` ms; the ranks run with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave RSS at once. The peak
  over the timed steps (after ``--warmup`` steps: partitioning, profiling and
  the optimizer's lazy state are done) minus the RSS *before the model is
  built* (after imports, ``mpar.init`` and the lazy imports an optimizer and
  partitioning trigger): what training adds to a process.
* **predicted peak**: ``plan.rank_memory_bytes[pp_rank]`` of the plan the
  runtime made (``DistributedModel.plan``; for pp=1, where the runtime makes
  none, ``make_plan`` on the same kind of profile), with the layout's knobs.
* **measured step**: median seconds of the ``@mpar.step`` call (forward,
  backward, gradient sync; the optimizer update is outside, as in the plan);
  **predicted step**: ``plan.step_time_s`` (profiled unit times, simulated schedule,
  data-parallel sync at ``--link-bandwidth``).

``--auto`` also runs the top candidates of one ``mpar plan --auto`` search on the
same model and compares their predicted and measured step-time order.

    python benchmarks/plan_accuracy.py                 # the grid, ~5 minutes on 2 cores
    python benchmarks/plan_accuracy.py --auto          # + the top-3 order check
    python benchmarks/plan_accuracy.py --quick --out /tmp/acc
    python benchmarks/plan_accuracy.py --budget        # + --auto's picks under 150/200/300 MiB
    python benchmarks/plan_accuracy.py --only 12 13    # rerun rows, keep the others' results
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Spec:
    """The model and batch every layout trains."""

    vocab: int = 8192
    d_model: int = 256
    layers: int = 6
    heads: int = 4
    seq: int = 64
    batch: int = 16
    """Global batch (all replicas)."""
    experts: int = 0
    """> 0: a mixture-of-experts GPT (``ep_peers.common.MoEGPT``: every block's MLP is
    ``experts`` GELU MLPs of ``4 d_model`` hidden features, top-2) instead of TinyGPT."""


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    zero: int = 0
    checkpointing: bool = False
    microbatches: int = 4
    pipeline: str = "interleaved"
    virtual_stages: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    gather: str | int = "unit"
    """``zero.gather`` (split-backward pipelines gather by chunk whatever it says)."""
    precision: str = "fp32"
    offload: str = ""
    """"opt", "param" or "opt+param": ``zero.offload_optimizer`` / ``offload_params``."""
    spec: dict[str, Any] = field(default_factory=dict)
    """Overrides of the grid's ``Spec`` (vocabulary, layers, global batch)."""
    profile_batch: int | None = None
    """pp=1: profile at this many samples and scale to the microbatch (None: the microbatch)."""
    raw: dict[str, Any] | None = None
    """A whole mpar config (an auto plan's) instead of the fields above."""
    name: str = ""
    cp: int = 1
    """``context_parallel_degree``: the ranks of a CP group split each sequence."""
    cp_method: str = "ring"

    def label(self) -> str:
        if self.name:
            return self.name
        ck = " ckpt" if self.checkpointing else ""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        g = f" gather={self.gather}" if self.gather != "unit" else ""
        prec = f" {self.precision}" if self.precision != "fp32" else ""
        off = f" offload={self.offload}" if self.offload else ""
        spec = "".join(f" {k}={v}" for k, v in self.spec.items())
        prof = f" profiled@{self.profile_batch}" if self.profile_batch else ""
        ep = self.extra.get("expert_parallel_degree", 1)
        eps = f" ep{ep}" if ep > 1 else ""
        cp = f" x cp{self.cp} {self.cp_method}" if self.cp > 1 else ""
        return (
            f"pp{self.pp} x dp{self.dp}{cp}{eps} z{self.zero}{ck} m{self.microbatches}{v} "
            f"{self.pipeline}{g}{prec}{off}{spec}{prof}"
        )

    def config(self) -> dict[str, Any]:
        if self.raw is not None:
            return dict(self.raw)
        zero: dict[str, Any] = {"stage": self.zero, "gather": self.gather}
        if "opt" in self.offload:
            zero["offload_optimizer"] = "cpu"
        if "param" in self.offload:
            zero["offload_params"] = "cpu"
        return {
            "pipeline_parallel_degree": self.pp,
            "microbatches": self.microbatches,
            "pipeline": self.pipeline,
            "virtual_stages": self.virtual_stages,
            "zero": zero,
            "activation_checkpointing": self.checkpointing,
            "memory_weight": 0.0,
            "bf16": self.precision == "bf16",
            "fp16": self.precision == "fp16",
            "context_parallel_degree": self.cp,
            "context_parallel_method": self.cp_method,
            **self.extra,
        }

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp


LONG = {"vocab": 1024, "layers": 4, "seq": 2048, "batch": 2}
"""Long sequences for the context-parallel rows: 2 x 2048 tokens a step."""

CP_ROWS = [
    Layout(1, 1, 0, microbatches=1, spec=LONG),
    Layout(1, 1, 0, microbatches=1, spec=LONG, cp=2),
    Layout(1, 1, 0, microbatches=1, spec=LONG, cp=2, cp_method="all_to_all"),
    Layout(2, 1, 0, microbatches=2, spec=LONG, cp=2),
    Layout(1, 1, 1, microbatches=1, spec=LONG, cp=4),
]

ISSUE_MODEL = {"vocab": 32000, "layers": 8}
"""Issue 27's model: a 23M-parameter GPT-style TinyGPT with a 32000-token vocabulary
(d_model 256, 8 layers, 64 tokens), global batch 16."""


MOE_MODEL = {"vocab": 1024, "layers": 4, "experts": 8, "batch": 8}
"""The expert-parallel rows' model: 8 experts of 256 -> 1024 -> 256 per block (25M of
its 27M parameters), 64 tokens, global batch 8."""


def ep(degree: int) -> dict[str, Any]:
    return {"expert_parallel_degree": degree}


GRID = [
    Layout(1, 2, 0),
    Layout(1, 2, 1, True),
    Layout(1, 4, 3),
    Layout(2, 1, 0),
    Layout(2, 1, 0, True),
    Layout(2, 2, 1),
    Layout(2, 2, 2, True),
    Layout(2, 2, 3),
    Layout(4, 1, 0),
    Layout(4, 1, 0, True),
    # ZeRO-3 gathered by chunk: a split-backward schedule, and zero.gather "chunk"
    Layout(2, 2, 3, pipeline="zero_bubble"),
    Layout(1, 4, 3, gather="chunk"),
    # precision, offload, a large vocabulary, pp=1 x dp=4 ZeRO-2, another profile size
    Layout(1, 2, 0, precision="bf16"),
    Layout(2, 1, 0, precision="fp16"),
    Layout(2, 2, 1, True, precision="bf16"),
    Layout(1, 2, 2, offload="opt"),
    Layout(1, 2, 3, offload="param"),
    Layout(1, 2, 2, offload="opt", precision="bf16"),
    Layout(1, 1, 0, microbatches=4, spec={**ISSUE_MODEL, "batch": 8}),  # 2 samples
    Layout(1, 1, 0, microbatches=1, spec={**ISSUE_MODEL, "batch": 8}),  # 8 samples
    Layout(1, 4, 2),
    Layout(1, 4, 2, microbatches=1, precision="bf16", spec=ISSUE_MODEL),
    Layout(1, 4, 3, microbatches=1, precision="bf16", spec=ISSUE_MODEL),
    Layout(1, 2, 0, profile_batch=8),  # microbatches of 2 samples
    Layout(1, 2, 1, True, profile_batch=1, precision="bf16"),
    # expert parallelism (experts 1/ep per rank, their state over dp/ep, the all-to-alls)
    Layout(1, 2, 0, microbatches=1, spec=MOE_MODEL),
    Layout(1, 2, 0, microbatches=1, extra=ep(2), spec=MOE_MODEL),
    Layout(1, 2, 3, microbatches=1, extra=ep(2), spec=MOE_MODEL),
    Layout(2, 2, 1, microbatches=2, extra=ep(2), spec=MOE_MODEL),
    # context parallelism on long sequences (activations dominate), cp 1 beside it
    *CP_ROWS,
]


# -- worker side ---------------------------------------------------------------------


class RssSampler:
    """Samples this process's resident memory every ``interval`` seconds; peaks since ``reset``.

    Two figures from one read of ``/proc/self/statm``: the resident set (``rss``) and its
    anonymous part (``anon``: resident minus file-backed and shared pages, i.e. without the
    code pages of torch's libraries that a step touches for the first time).
    """

    def __init__(self, interval: float) -> None:
        self.interval, self._stop = interval, threading.Event()
        self.peak, self.peak_anon = 0, 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> tuple[int, int]:
        """(resident bytes, anonymous resident bytes) now."""
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        resident, shared = int(fields[1]) * PAGE, int(fields[2]) * PAGE
        return resident, resident - shared

    @staticmethod
    def rss() -> int:
        return RssSampler.read()[0]

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = self.read()
            self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
            time.sleep(self.interval)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def reset(self) -> None:
        self.peak, self.peak_anon = self.read()

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_anon


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor the interpreter can reach."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta and obj.device.type == "cpu":
            grad = obj.grad if isinstance(obj, torch.nn.Parameter) else None
            for t in (obj, grad):
                try:  # fake tensors (profiling's) have no data pointer
                    storage = t.untyped_storage() if t is not None else None
                    if storage is not None:
                        seen[storage.data_ptr()] = storage.nbytes()
                except RuntimeError:
                    pass
    seen.pop(0, None)
    return sum(seen.values())


def _model(spec: Spec) -> Any:
    import torch

    from mpar.testing.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    if spec.experts:
        from ep_peers.common import EPSpec, MoEGPT

        moe = EPSpec(
            vocab=spec.vocab, d_model=spec.d_model, d_expert=4 * spec.d_model,
            num_layers=spec.layers, num_heads=spec.heads, num_experts=spec.experts, seq=spec.seq,
        )  # fmt: skip
        return MoEGPT(moe)
    cfg = GPTConfig(
        vocab_size=spec.vocab,
        d_model=spec.d_model,
        num_layers=spec.layers,
        num_heads=spec.heads,
        d_ffn=4 * spec.d_model,
        max_seq_len=spec.seq,
        tie_embeddings=False,
    )
    return TinyGPT(cfg)


def _data(spec: Spec) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _pp1_plan(spec: Spec, layout: Layout, x: Any) -> Any:
    """The runtime makes no plan for one stage: make the one ``mpar plan`` makes from the
    resolved config, profiled at ``layout.profile_batch`` samples (default: the
    microbatch's) and scaled to the microbatch."""
    import mpar
    from mpar.expert_parallel import measure_ep_splits
    from mpar.partition import make_plan, measure_attention, plan_inputs
    from mpar.profile import profile_model

    config = mpar.config()
    model = _model(spec)
    inputs = plan_inputs(config, mpar.size(), device="cpu")
    mb = spec.batch // inputs.grid.dp // config.microbatches
    profiled = layout.profile_batch or mb
    profile = profile_model(model, (x[:profiled],), repeats=3, warmup=1)
    if config.expert_parallel_degree > 1:
        experts = measure_ep_splits(model, profile, ((x[:profiled],), {}), plan=config.ep_plan)
        inputs = dataclasses.replace(inputs, ep_splits=experts)
    if inputs.grid.cp > 1:  # whole sequences profiled: the plan takes one CP rank's share
        found = measure_attention(model, profile.units, (x[:profiled],))
        inputs = dataclasses.replace(inputs, cp_attention=found)
    return make_plan(profile, inputs, microbatch_scale=mb / profiled, microbatch_size=mb)


def _warm_imports() -> None:
    """Run what training runs once, lazily importing code, on a throwaway tiny model.

    An optimizer pulls in torch._dynamo (~70 MiB); profiling and splitting a
    model (torch.export, sympy, networkx, fx code in linecache) another ~60 MiB
    of modules and interpreter state. That is code, the same for every layout;
    doing it before the baseline leaves tensors and buffers in the peak.
    """
    import torch

    from mpar.partition import split_module
    from mpar.profile import profile_model
    from mpar.testing.models import GPTConfig, TinyGPT

    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    tiny = TinyGPT(GPTConfig(vocab_size=16, d_model=8, num_layers=2, num_heads=2, d_ffn=8))
    x = torch.zeros(2, 4, dtype=torch.long)
    profile_model(tiny, (x,), repeats=1, warmup=0)
    stages = split_module(tiny, (x,), None, [0, 4]).stages
    out = stages[1](*stages[0](x))
    out.sum().backward()


def _train(spec: Spec, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    import mpar

    mpar.init(layout.config())
    _warm_imports()
    gc.collect()
    sampler = RssSampler(args.sample_ms / 1e3).start()
    baseline, baseline_anon = RssSampler.read()
    baseline_tensors = live_tensor_bytes()
    model = mpar.DistributedModel(_model(spec))
    opt = mpar.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @mpar.step
    def train_step(m: Any, x: Any, y: Any) -> Any:
        logits = m(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        m.backward(loss)
        return loss

    x, y = _data(spec)
    dp = mpar.dp_size()
    share = slice(mpar.dp_rank() * spec.batch // dp, (mpar.dp_rank() + 1) * spec.batch // dp)
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            mpar.barrier()
            sampler.reset()
        start = time.perf_counter()
        train_step(model, x[share], y[share])
        times.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
    peak, peak_anon = sampler.stop()
    gc.collect()  # at rest: what a process holds between steps besides tensors
    rest, rest_anon = RssSampler.read()
    rest_tensors = live_tensor_bytes() - baseline_tensors
    plan = model.plan if mpar.pp_size() > 1 else _pp1_plan(spec, layout, x)
    return {
        "rank": mpar.rank(),
        "pp_rank": mpar.pp_rank(),
        "dp_rank": mpar.dp_rank(),
        "measured_peak_bytes": peak_anon - baseline_anon,
        "measured_rss_peak_bytes": peak - baseline,
        "baseline_bytes": baseline,
        "baseline_anon_bytes": baseline_anon,
        "rest_anon_bytes": rest_anon - baseline_anon,
        "rest_rss_bytes": rest - baseline,
        "rest_tensor_bytes": rest_tensors,
        "predicted_peak_bytes": plan.rank_memory_bytes[mpar.pp_rank()],
        "predicted_host_bytes": (plan.host_memory_bytes or [0] * 8)[mpar.pp_rank()],
        "predicted_gather": plan.layout.gather,
        "measured_step_s": statistics.median(times[args.warmup :]),
        "predicted_step_s": plan.step_time_s,
        "boundaries": list(plan.boundaries),
        "report": mpar.memory_report(),
        "stages": [
            {k: getattr(s, k) for k in ("stage", "state_bytes", "activation_bytes", "extra_bytes")}
            for s in plan.stages
            if s.rank == mpar.pp_rank()
        ],
    }


def _worker(args: argparse.Namespace) -> None:
    spec, raw = Spec(**json.loads(args.spec)), json.loads(args.worker)
    spec = Spec(**{**asdict(spec), **raw.get("spec", {})})
    result = _train(spec, Layout(**raw), args)
    Path(args.result, f"rank{result['rank']}.json").write_text(json.dumps(result))
    import mpar

    mpar.shutdown()


# -- launching -----------------------------------------------------------------------


def _launch(spec: Spec, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """One job; retried once (4-rank jobs on this 2-core machine now and then die of
    SIGABRT, cause not found); a retry is recorded in the result."""
    got = _launch_once(spec, layout, args)
    if got["status"] != "ok":
        print(f"{layout.label()}: failed, retrying once", flush=True)
        again = _launch_once(spec, layout, args)
        again["retried_after"] = got["reason"][-300:]
        return again
    return got


def _launch_once(spec: Spec, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS=str(args.threads),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH", "")])),
    )
    world = layout.world
    with tempfile.TemporaryDirectory(prefix="mpar-plan-acc-") as tmp:
        cmd = [sys.executable, "-m", "mpar", "launch", "--nproc-per-node", str(world)]
        cmd += [str(Path(__file__).resolve()), "--worker", json.dumps(asdict(layout))]
        cmd += ["--spec", json.dumps(asdict(spec)), "--result", tmp]
        cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
        cmd += ["--sample-ms", str(args.sample_ms)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != world:
            return {"status": "failed", "reason": (proc.stderr or proc.stdout)[-1500:]}
        ranks = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])
    return {"status": "ok", "ranks": ranks}


def _summary(layout: Layout, got: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"layout": layout.label(), **asdict(layout), "status": got["status"]}
    if "retried_after" in got:
        row["retried_after"] = got["retried_after"]
    if got["status"] != "ok":
        row["reason"] = got["reason"]
        return row
    ranks = got["ranks"]
    row["ranks"] = [
        {
            "rank": r["rank"],
            "pp_rank": r["pp_rank"],
            "predicted_mib": r["predicted_peak_bytes"] / 2**20,
            "measured_mib": r["measured_peak_bytes"] / 2**20,
            "measured_rss_mib": r["measured_rss_peak_bytes"] / 2**20,
            "rest_anon_mib": r["rest_anon_bytes"] / 2**20,
            "rest_tensor_mib": r["rest_tensor_bytes"] / 2**20,
            "ratio": r["measured_peak_bytes"] / max(r["predicted_peak_bytes"], 1),
            "predicted_gather": r["predicted_gather"],
            "memory_report": r["report"],
            "plan_stages": r["stages"],
        }
        for r in ranks
    ]
    row["predicted_step_s"] = ranks[0]["predicted_step_s"]
    row["measured_step_s"] = max(r["measured_step_s"] for r in ranks)
    row["step_ratio"] = row["measured_step_s"] / row["predicted_step_s"]
    row["boundaries"] = ranks[0]["boundaries"]
    return row


def issue_model() -> tuple[Any, Any]:
    """``mpar plan --model plan_accuracy:issue_model``: issue 27's model with one replica's
    share of the global batch (4 samples) as the example."""
    spec = Spec(**ISSUE_MODEL)
    x, _ = _data(spec)
    return _model(spec), x[:4]


def _auto_plan(cap_mib: int, args: argparse.Namespace) -> dict[str, Any]:
    """``mpar plan --auto`` on issue 27's model for 4 ranks and a global batch of 16
    (``{"error": ...}`` when it finds no layout under the cap)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(HERE.parent)]))
    cmd = [sys.executable, "-m", "mpar", "plan", "--auto", "--model", "plan_accuracy:issue_model"]
    cmd += ["--world-size", "4", "--device-memory", f"{cap_mib}MiB", "--global-batch", "16"]
    cmd += ["--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-600:]}
    return dict(json.loads(proc.stdout))


def _smallest_layout() -> dict[str, Any]:
    """The layout of least predicted peak for issue 27's model (any cap): what a refusal
    is checked against."""
    from mpar.config import load_config
    from mpar.partition import plan_inputs, search
    from mpar.profile import profile_model

    model, x = issue_model()
    profile = profile_model(model, (x,), repeats=1, warmup=0)
    inputs = plan_inputs(load_config({"device_memory": "64GiB"}), 4, device="cpu")
    result = search(profile, inputs, global_batch=16, profile_batch=4, top=100000)
    best = min(result.ranked, key=lambda c: c.max_rank_memory_bytes)
    return {
        "config": best.config(),
        "candidates": [best.to_dict()],
        "predicted": {"max_rank_memory_bytes": best.max_rank_memory_bytes},
    }


def _budget_check(args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]]]:
    """Each cap: the auto plan's pick, run for real (each replica its share of the
    batch); every rank's measured peak must stay under the cap. Where the planner finds
    nothing, the layout of least predicted peak runs instead: it must not fit either."""
    spec = Spec(**ISSUE_MODEL)
    out, text = [], []
    for cap in args.caps:
        plan = _auto_plan(cap, args)
        refused = plan.get("error")
        if refused:
            plan = _smallest_layout()
        config = plan["config"]
        pp = config["pipeline_parallel_degree"]
        best = plan["candidates"][0]
        name = (
            f"{'refused; smallest' if refused else 'chosen'}: pp{pp} x dp{4 // pp} "
            f"z{config['zero']['stage']} m{config['microbatches']}x{best['microbatch_size']} "
            f"{config.get('pipeline')} v{config.get('virtual_stages')} {best['precision']}"
            f"{' ckpt' if config['activation_checkpointing'] else ''}"
            f"{' offload' if best['offload_optimizer'] or best['offload_params'] else ''}"
        )
        layout = Layout(pp, 4 // pp, raw=config, spec=ISSUE_MODEL, name=f"cap {cap}: {name}")
        got = _launch(spec, layout, args)
        row = _summary(layout, got)
        row.update(cap_mib=cap, auto_predicted=plan["predicted"], auto_config=config)
        row["refused"] = refused or None
        if got["status"] == "ok":
            worst = max(r["measured_mib"] for r in row["ranks"])
            worst_rss = max(r["measured_rss_mib"] for r in row["ranks"])
            fits = worst_rss < cap
            row.update(worst_mib=worst, worst_rss_mib=worst_rss, under_cap=fits)
            row["verdict"] = (
                ("right: nothing fits" if not fits else "WRONG: it fits")
                if (refused)
                else ("under the cap" if fits else "OVER THE CAP")
            )
        out.append(row)
        print(f"{layout.label()}: {got['status']} {row.get('worst_mib')}", flush=True)
    text += [
        "| cap MiB | layout run | predicted MiB (busiest) | measured MiB per rank (anon) | "
        "RSS MiB (busiest) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row in out:
        ranks = row.get("ranks", [])
        measured = ", ".join(f"{r['measured_mib']:.1f}" for r in ranks)
        text.append(
            f"| {row['cap_mib']} | {row['layout']} | "
            f"{row['auto_predicted']['max_rank_memory_bytes'] / 2**20:.1f} | "
            f"{measured or row.get('reason', '')[-80:]} | "
            f"{row.get('worst_rss_mib', 0):.1f} | {row.get('verdict', 'failed')} |"
        )
    text += [
        "",
        "Command: `python benchmarks/plan_accuracy.py --budget-only` (each plan: `mpar plan "
        "--auto --model plan_accuracy:issue_model --world-size 4 --device-memory <cap>MiB "
        "--global-batch 16 --json` with PYTHONPATH=benchmarks; the model: TinyGPT, vocabulary "
        "32000, d_model 256, 8 layers, 64 tokens, 23M parameters; each replica trains its "
        "16/dp samples). Under the cap: the whole RSS above the baseline (code pages "
        "included), busiest rank. Where `mpar plan --auto` finds no layout, the layout of "
        "least predicted peak (any cap) runs instead, to check the refusal.",
    ]
    return text, out


def _markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    loads = meta.get("load", [])
    lines = [
        "# Planner calibration: predicted vs measured",
        "",
        f"Model: TinyGPT {report['spec']} unless a row says otherwise (vocab=32000 layers=8: "
        "issue 27's 23M-parameter model); Adam; fp32 unless a row names bf16/fp16; "
        f"{meta['warmup']} warm-up + "
        f"{meta['steps']} timed steps; {meta['threads']} thread(s) per rank; the plans' "
        "default cost model (10 GB/s links, process memory 5 MiB + 6 MiB on pipeline ranks "
        "and 3.5 MiB more per MoE layer there + 12 MiB under bf16/fp16; device cpu). "
        "Measured = peak of the sampled *anonymous* resident memory (RSS less file-backed "
        "code pages) above its value before the model was built "
        "(MALLOC_MMAP_THRESHOLD_=65536); RSS = the same for the whole resident set. "
        "Non-tensor = anonymous RSS at rest after the last step minus the bytes of every live "
        "tensor. Gather: how the plan models ZeRO 2/3 inside a stage (the runtime's "
        "zero.gather; split-backward schedules gather by chunk). "
        "Ratio = measured / predicted."
        + (f" 1-minute load average (2 cores): {loads[0]:.1f} at the start, "
           f"{loads[-1]:.1f} at the end." if loads else ""),
        "",
        "| layout | rank (pp) | predicted MiB | measured MiB | ratio | RSS MiB | non-tensor "
        "MiB | gather | predicted step ms | measured step ms | step ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in report["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['layout']} | failed: {row['reason'][-120:]!r} |" + " |" * 9)
            continue
        for i, r in enumerate(row["ranks"]):
            step = (
                f"{row['predicted_step_s'] * 1e3:.1f} | {row['measured_step_s'] * 1e3:.1f} | "
                f"{row['step_ratio']:.2f}"
                if i == 0
                else " | | "
            )
            lines.append(
                f"| {row['layout'] if i == 0 else ''} | {r['rank']} ({r['pp_rank']}) | "
                f"{r['predicted_mib']:.1f} | {r['measured_mib']:.1f} | {r['ratio']:.2f} | "
                f"{r['measured_rss_mib']:.1f} | {r['rest_anon_mib'] - r['rest_tensor_mib']:.1f} | "
                f"{r.get('predicted_gather', '')} | {step} |"
            )
    ok = [r for row in report["rows"] if row["status"] == "ok" for r in row["ranks"]]
    if ok:
        ratios = [r["ratio"] for r in ok]
        lines += ["", _ratio_line("Peak ratios", ratios)]
    if report.get("budget"):
        lines += ["", "## `--auto` against a budget (issue 27's model)", "", *report["budget"]]
    if report.get("auto"):
        lines += ["", "## Top candidates of one auto plan", "", *report["auto"]]
    lines += ["", "What is off, and why: [docs/planning.md](../../docs/planning.md#calibration)."]
    return "\n".join(lines) + "\n"


def _ratio_line(what: str, ratios: list[float]) -> str:
    inside = sum(0.85 <= r <= 1.15 for r in ratios)
    return (
        f"{what}: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, "
        f"max {max(ratios):.2f}; {inside} of {len(ratios)} ranks within 0.85-1.15x."
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--only", type=int, nargs="*", help="indices into the grid")
    p.add_argument("--auto", action="store_true", help="also check one auto plan's top 3")
    p.add_argument("--auto-only", action="store_true", help="only the top-3 check")
    p.add_argument("--auto-repeats", type=int, default=3, help="runs per top-3 candidate")
    p.add_argument("--quick", action="store_true", help="small model, 2 layouts")
    p.add_argument("--cp", action="store_true", help="only the context-parallel rows")
    p.add_argument("--budget", action="store_true", help="also run --auto's picks under caps")
    p.add_argument("--budget-only", action="store_true", help="only the budget check")
    p.add_argument("--caps", type=int, nargs="*", default=[150, 200, 300], help="MiB")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _ms(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds * 1e3:.1f}"


def _auto_profile(
    spec: Spec, args: argparse.Namespace, small: int, large: int, rounds: int = 3
) -> Any:
    """Profile at ``large`` samples with per-call fixed times fitted against ``small``:
    the candidates' microbatch sizes lie between the two, so their times interpolate.

    The fit takes a difference of two timings, so load that changes between them would
    land in it: the two sizes are profiled alternately, ``rounds`` times each, and every
    unit keeps its fastest time per size (interference only ever adds time).
    """
    import dataclasses

    import torch

    from mpar.partition import fit_fixed_times
    from mpar.profile import profile_model

    torch.set_num_threads(args.threads)
    x, _ = _data(spec)
    model = _model(spec)
    best: dict[int, Any] = {}
    for _ in range(rounds):
        for n in (small, large):
            got = profile_model(model, (x[:n],), repeats=3, warmup=1)
            if n in best:
                fastest = [
                    min(a, b, key=lambda u: u.time_s) for a, b in zip(best[n].units, got.units)
                ]
                got = dataclasses.replace(got, units=fastest)
            best[n] = got
    return fit_fixed_times(best[large], large, best[small], small)


def _ratio_medians(runs: list[list[float | None]]) -> list[float | None]:
    """Per candidate: the median over rounds of its time / the first candidate's time in
    the same round (rounds where either failed are left out)."""
    out: list[float | None] = []
    for times in runs:
        ratios = [t / t0 for t, t0 in zip(times, runs[0]) if t is not None and t0 is not None]
        out.append(statistics.median(ratios) if ratios else None)
    return out


def _auto_check(spec: Spec, args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]]]:
    """Measure the top 3 of one auto search on 2 ranks (fp32, no offload, ZeRO-0)."""
    from mpar.partition import SearchSpace, search

    per_replica = spec.batch // 2
    profile = _auto_profile(spec, args, 2, per_replica)
    # ZeRO-0 only: ZeRO-1/2 predict the same time as ZeRO-0 (same traffic), and ties say
    # nothing about order; what is left differs in pp, m, v, schedule and checkpointing.
    space = SearchSpace(precisions=("fp32",), offload=False, zero_stages=(0,))
    result = search(
        profile, world_size=2, device_memory="1GiB", global_batch=spec.batch, space=space,
        profile_batch=per_replica, top=3,
    )  # fmt: skip
    layouts = [
        Layout(
            c.pipeline_parallel_degree,
            c.data_parallel_degree,
            c.zero_stage,
            c.activation_checkpointing,
            c.microbatches,
            c.pipeline,
            c.virtual_stages,
        )
        for c in result.ranked
    ]
    runs: list[list[float | None]] = [[] for _ in layouts]
    loads = []
    for _ in range(args.auto_repeats):  # A B C A B C ...: the machine's drift hits all alike
        loads.append(os.getloadavg()[0])
        for i, layout in enumerate(layouts):
            got = _launch(spec, layout, args)
            ok = got["status"] == "ok"
            runs[i].append(max(r["measured_step_s"] for r in got["ranks"]) if ok else None)
    ratios = _ratio_medians(runs)
    first = result.ranked[0].step_time_s or 1.0
    out = [
        {
            "layout": layout.label(),
            "search_predicted_s": c.step_time_s,
            "predicted_ratio": (c.step_time_s or 0.0) / first,
            "measured_runs_s": times,
            "measured_s": statistics.median([t for t in times if t is not None] or [0.0]),
            "measured_ratio": ratio,
        }
        for layout, c, times, ratio in zip(layouts, result.ranked, runs, ratios)
    ]
    rows = [
        f"| {o['layout']} | {(o['search_predicted_s'] or 0) * 1e3:.1f} | "
        f"{o['predicted_ratio']:.3f} | {_ms(o['measured_s'])} | "
        f"{'failed' if o['measured_ratio'] is None else format(o['measured_ratio'], '.3f')} | "
        f"{', '.join(_ms(t) for t in o['measured_runs_s'])} |"
        for o in out
    ]
    order_ok = None not in ratios and ratios == sorted(ratios)  # type: ignore[type-var]
    text = [
        "| candidate (search rank order) | predicted step ms | predicted / first | "
        "measured step ms (median) | measured / first (median of per-round ratios) | runs ms |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"{args.auto_repeats} rounds, candidates alternating within each round (A B C A B C "
        f"...); 1-minute load average at the start of each round: "
        f"{', '.join(f'{x:.1f}' for x in loads)} (2 cores). Profile at {per_replica} samples, "
        "per-call fixed times fitted against 2 samples (the candidates' microbatch sizes lie "
        "between). Measured order (by the median of per-round ratios to the first "
        f"candidate) matches the predicted order: {'yes' if order_ok else 'no'}.",
    ]
    return text, out


def _save_partial(report: dict[str, Any], args: argparse.Namespace) -> None:
    """What has run so far, beside the results (a long run can be cut short)."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_accuracy.partial.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    spec = Spec(vocab=512, d_model=64, layers=4, heads=4, seq=32, batch=8) if args.quick else Spec()
    grid = GRID[:2] if args.quick else [GRID[i] for i in args.only] if args.only else GRID
    grid = CP_ROWS if args.cp else grid
    grid = [] if args.auto_only or args.budget_only else grid
    rows, load = [], [os.getloadavg()[0]]
    report: dict[str, Any] = {"spec": asdict(spec), "rows": rows}
    if args.budget or args.budget_only:
        report["budget"], report["budget_rows"] = _budget_check(args)
        _save_partial(report, args)
    for layout in grid:
        got = _launch(spec, layout, args)
        rows.append(_summary(layout, got))
        shown = rows[-1].get("step_ratio", rows[-1].get("reason", "")[-200:])
        print(f"{layout.label()}: {got['status']} {shown}", flush=True)
        _save_partial(report, args)
    report["meta"] = {
        **{k: getattr(args, k) for k in ("warmup", "steps", "threads")},
        "load": [*load, os.getloadavg()[0]],
    }
    if args.auto or args.auto_only:
        report["auto"], report["auto_rows"] = _auto_check(spec, args)
    args.out.mkdir(parents=True, exist_ok=True)
    old_file = args.out / "plan_accuracy.json"
    old = json.loads(old_file.read_text()) if old_file.exists() else {}
    if (args.auto_only or args.budget_only) and old:  # keep the grid
        report["rows"], report["meta"] = old["rows"], old["meta"]
    elif (args.only or args.cp) and old:  # replace the rows run, keep the others
        by_label = {r["layout"]: r for r in old.get("rows", [])}
        by_label.update({r["layout"]: r for r in rows})
        order = [g.label() for g in GRID]
        report["rows"] = sorted(
            by_label.values(),
            key=lambda r: order.index(r["layout"]) if r["layout"] in order else len(order),
        )
    for key in ("budget", "budget_rows", "auto", "auto_rows"):
        if key not in report and key in old:
            report[key] = old[key]
    (args.out / "plan_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    text = _markdown(report)
    (args.out / "plan_accuracy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
