"""The device seam on a real XLA device (PJRT's CPU): one process, no ranks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_xla", reason="needs torch_xla (run by CI's XLA job, .ci/xla)")

from mpar import _device
from mpar.errors import ConfigError


@pytest.fixture(scope="module")
def xla() -> torch.device:
    return _device.pick_device("xla", 0)


def test_pick_device_and_backend(xla):
    assert xla.type == "xla"
    assert _device.xla_runtime() == "CPU"
    assert _device.default_backend(xla, 1) == "gloo"  # PJRT CPU: host-staged
    assert _device.wire_device(xla, "gloo") == torch.device("cpu")


def test_xla_backend_on_pjrt_cpu_is_refused(xla):
    with pytest.raises(ConfigError, match="does not reduce across processes"):
        _device.check_backend(xla, "xla")


def test_same_memory_on_xla_tensors_which_have_no_data_pointers(xla):
    flat, other = torch.zeros(8, device=xla), torch.zeros(8, device=xla)
    assert flat.data_ptr() == other.data_ptr()  # why data_ptr cannot tell them apart
    assert not _device.same_memory(flat, other)
    assert _device.same_memory(flat[2:4], flat[2:6])
    assert not _device.same_memory(flat[2:4], flat[0:4])


def test_move_module_to_xla_keeps_parameters_for_an_earlier_optimizer(xla):
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    weight = net.weight
    before = weight.detach().clone()
    _device.move_module(net, xla)
    assert net.weight is weight and weight.device.type == "xla"
    net(torch.ones(4, 3, device=xla)).sum().backward()
    opt.step()
    _device.after_optimizer_step(xla)
    torch.testing.assert_close(weight.detach().cpu(), before - 4.0, rtol=0, atol=1e-6)


def test_copies_and_statistics(xla):
    host = _device.host_buffer(4, torch.float32, xla)
    assert host.device.type == "cpu" and not host.is_pinned()
    _device.copy_(host, torch.arange(4.0, device=xla))
    _device.wait_copies(xla)
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    moved = _device.to_device((host, "x"), xla)
    assert moved[0].device.type == "xla" and moved[1] == "x"
    _device.synchronize([xla])
    assert _device.memory_stats(xla) == {}  # PJRT CPU keeps no allocator statistics


def test_recompute_on_xla_draws_the_same_dropout_masks(xla):
    """Activation checkpointing on XLA: the recomputed forward restores the device's
    RNG, so its dropout masks (and so the gradients) are those of the plain forward."""
    import torch_xla.core.xla_model as xm

    from mpar.config import load_config
    from mpar.runtime._recompute import run_stage

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 2))
    _device.move_module(net, xla)
    x = torch.randn(4, 8).to(xla)

    def grads(config: dict) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        xm.set_rng_state(1234)
        run_stage(net, (x,), {}, load_config(config), xla).sum().backward()
        return [p.grad.cpu() for p in net.parameters()]

    plain = grads({})
    recomputed = grads({"activation_checkpointing": True})
    assert float(plain[0].abs().sum()) > 0
    for got, want in zip(recomputed, plain):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
