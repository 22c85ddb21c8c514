"""The device seam (``mpar._device``): what it decides, and that nothing else decides it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from mpar import _device
from mpar.config import load_config
from mpar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
CPU, XLA, CUDA = torch.device("cpu"), torch.device("xla", 0), torch.device("cuda", 0)


def test_device_branches_live_only_in_the_seam():
    """The acceptance check of the seam (``_device.py`` and its side streams,
    ``_streams.py``): no other module of mpar tests a device's type, calls torch.cuda
    or torch_xla, pins memory or copies non-blocking."""
    pattern = re.compile(
        r"\.type\s*(==|!=|in\b)|torch\.cuda|torch_xla|pin_memory\s*=|is_pinned|non_blocking\s*="
    )
    hits = []
    for path in sorted((ROOT / "mpar").rglob("*.py")):
        if path.name in ("_device.py", "_streams.py"):  # the seam, and its streams
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "device branches outside mpar/_device.py:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    ("device", "backend", "wire"),
    [
        (CPU, "gloo", CPU),
        (CPU, "mpi", CPU),
        (CUDA, "nccl", CUDA),
        (CUDA, "gloo", CPU),  # host-staged
        (XLA, "gloo", CPU),  # host-staged: PJRT CPU, and any pipeline
        (XLA, "xla", XLA),  # the XLA process group takes XLA tensors
    ],
)
def test_wire_device_stages_what_the_backend_cannot_take(device, backend, wire):
    assert _device.wire_device(device, backend) == wire


def test_pipeline_transfers_of_xla_always_go_through_the_host():
    assert _device.p2p_device(XLA, "xla") == CPU
    assert _device.p2p_device(XLA, "gloo") == CPU
    assert _device.p2p_device(CUDA, "nccl") == CUDA
    assert _device.p2p_device(CPU, "gloo") == CPU


def test_group_backends():
    assert _device.group_backends("gloo") == ("gloo", "gloo")
    assert _device.group_backends("nccl") == ("nccl", "nccl")


def test_cpu_and_cuda_backends_by_default():
    assert _device.default_backend(CPU, 2) == "gloo"
    assert _device.default_backend(CUDA, 1) == "nccl"
    assert _device.default_backend(XLA, 2) == "gloo"  # pipelines never use XLA collectives


def test_same_memory_and_storage_key_follow_views():
    flat = torch.zeros(10)
    assert _device.same_memory(flat[2:5], flat[2:4])
    assert not _device.same_memory(flat[2:5], flat[3:5])
    assert not _device.same_memory(flat, torch.zeros(10))
    assert _device.storage_key(flat[4:]) == _device.storage_key(flat)
    assert _device.storage_key(flat) != _device.storage_key(torch.zeros(10))


def test_host_buffers_and_copies_on_the_cpu():
    buffer = _device.host_buffer(6, torch.float32, CPU)
    assert buffer.device == CPU and buffer.numel() == 6 and not buffer.is_pinned()
    source = torch.arange(6.0)
    assert torch.equal(_device.copy_(buffer, source), source)
    moved = _device.to_device({"a": [source], "b": 3}, CPU)
    assert moved["a"][0] is source and moved["b"] == 3
    _device.wait_copies(CPU)
    _device.after_action(CPU)
    _device.after_optimizer_step(CPU)
    _device.synchronize([CPU])
    assert _device.memory_stats(CPU) == {}


def test_activation_offload_is_nothing_on_the_cpu():
    with _device.activation_offload(CPU) as ctx:
        assert ctx is None


def test_move_module_keeps_parameter_objects():
    net = torch.nn.Linear(2, 2)
    weight = net.weight
    _device.move_module(net, CPU)
    assert net.weight is weight


def test_cpu_and_auto_devices():
    assert _device.pick_device("cpu", 0) == CPU
    if not torch.cuda.is_available():
        assert _device.pick_device("auto", 3) == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="'device' is 'cuda'.*use device 'cpu'"):
        _device.pick_device("cuda", 0)


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here")
def test_xla_without_torch_xla_is_a_config_error():
    with pytest.raises(ConfigError, match="torch_xla is not installed: pip install torch_xla"):
        _device.pick_device("xla", 0)


def test_unknown_device_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="'tpu'"):
        _device.pick_device("tpu", 0)


def test_xla_backend_needs_the_xla_device():
    with pytest.raises(ConfigError, match="backend' is 'xla' but 'device' is 'cpu'"):
        load_config({"device": "cpu", "backend": "xla"})


def test_xla_backend_refuses_pipelines():
    with pytest.raises(ConfigError, match="pipeline_parallel_degree 2"):
        load_config({"device": "xla", "backend": "xla", "pipeline_parallel_degree": 2})


def test_nccl_with_more_ranks_than_gpus_is_a_config_error(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"2 ranks on this host but 1 visible GPU.*'gloo'"):
        _device.check_ranks_per_device(gpu, "nccl", 2)
    _device.check_ranks_per_device(gpu, "nccl", 1)  # one rank per GPU
    _device.check_ranks_per_device(gpu, "gloo", 2)  # host-staged: any number
    _device.check_ranks_per_device(torch.device("cpu"), "nccl", 2)  # not this check's


def test_the_sync_ledger_counts_host_reads_by_reason():
    import torch

    from mpar import _device
    from mpar.runtime._output import detach_to_cpu

    _device.SYNCS.take()
    assert _device.host_value(torch.tensor(3.0), "a read") == 3.0
    outputs = detach_to_cpu([{"loss": torch.tensor(1.0)} for _ in range(8)])
    assert len(outputs) == 8
    # eight microbatch outputs, one wait; nothing counted twice
    assert _device.SYNCS.take() == {"a read": 1, "step outputs to the host": 1}
    assert _device.SYNCS.take() == {}


def test_sync_debug_turns_torch_mode_on_in_a_step_and_exempts_the_ledger(monkeypatch):
    """With MPAR_SYNC_DEBUG and CUDA in use, torch's sync debug mode is on inside the
    step and off for the ledger's own waits, so only uncounted syncs warn or raise."""
    calls: list[object] = []
    mode = [0]

    def set_mode(value):
        calls.append(value)
        mode[0] = value

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setenv(_device.SYNC_DEBUG_ENV, "error")
    _device.SYNCS.take()
    with _device.sync_debug():
        assert _device.host_value(torch.tensor(2.0), "a read") == 2.0
        with _device.sync_debug():  # nested: stays on
            pass
        assert mode[0] == "error"
    assert calls == ["error", 0, "error", 0]
    assert _device.SYNCS.take() == {"a read": 1}
    monkeypatch.setenv(_device.SYNC_DEBUG_ENV, "loud")
    with pytest.raises(ConfigError, match="MPAR_SYNC_DEBUG is 'loud'"), _device.sync_debug():
        pass
    monkeypatch.delenv(_device.SYNC_DEBUG_ENV)
    calls.clear()
    with _device.sync_debug():
        _device.host_value(torch.tensor(1.0), "a read")
    assert calls == []


def test_device_memory_is_read_from_the_device_where_one_is_there(monkeypatch):
    """Without ``device_memory`` an "auto" config is refused on the CPU; on CUDA the
    device's memory is read (stood in for here), by the config and by ``mpar plan``."""
    import argparse

    import mpar
    from mpar.cli._plan import device_memory_of
    from mpar.config import config_from_dict

    with pytest.raises(ConfigError, match="'device_memory' is not set"):
        config_from_dict({"microbatches": "auto", "device": "cpu"})
    if not torch.cuda.is_available():
        assert _device.total_memory("auto") is None and _device.total_memory(CPU) is None
        with pytest.raises(ConfigError, match="does not report its memory"):  # at init
            mpar.init({"microbatches": "auto"})
    assert mpar.is_initialized() is False
    monkeypatch.setattr(_device, "total_memory", lambda device: 80 * 2**30)
    assert config_from_dict({"microbatches": "auto"}).auto_keys == ("microbatches",)
    args = argparse.Namespace(device_memory=None, cluster=None, device="cuda")
    assert device_memory_of(args, None) == 80 * 2**30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_report_on_cuda_gives_reserved_and_each_steps_own_peak():
    import mpar

    mpar.init({"device": "cuda", "microbatches": 1})
    model = mpar.DistributedModel(torch.nn.Linear(256, 256).cuda())

    @mpar.step
    def forward(m, x):
        loss = m(x).square().mean()
        m.backward(loss)
        return loss

    try:
        peaks = []
        for rows in (8192, 64):  # a big step, then a small one
            forward(model, torch.randn(rows, 256, device="cuda"))
            row = mpar.memory_report()[str(torch.device("cuda", 0))]
            assert row["device_reserved"] >= row["device_allocated"] > 0
            peaks.append(row["device_peak"])
        assert peaks[1] < peaks[0] - 4 * 8192 * 256  # the second peak is the second step's
    finally:
        mpar.shutdown()


def test_side_streams_only_where_the_backend_takes_the_devices_tensors():
    """ZeRO's collectives go on CUDA side streams with NCCL (or a group of one, which
    never communicates); host-staged backends and the CPU keep the one host stream, whose
    tickets wait for the collective's handle as before."""
    from mpar import _streams

    assert isinstance(_streams.streams_for(CUDA, "nccl"), _streams.CudaStreams)
    assert isinstance(_streams.streams_for(CUDA, None), _streams.CudaStreams)
    assert not isinstance(_streams.streams_for(CUDA, "gloo"), _streams.CudaStreams)
    host = _streams.streams_for(CPU, "gloo")
    assert not host.overlaps and not isinstance(host, _streams.CudaStreams)

    class Handle:
        waited = 0

        def wait(self):
            Handle.waited += 1

    ticket = host.issue("gather", "x", Handle)
    assert Handle.waited == 0  # issued, not waited
    ticket.wait()
    ticket.wait()
    assert Handle.waited == 1
