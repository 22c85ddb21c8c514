"""ZeRO CPU offload and mixed precision on a CUDA device (skipped without a GPU).

One process on one GPU (NCCL, a data-parallel group of one): the offload
paths that only exist on CUDA run here — pinned host buffers, non-blocking
device/host copies of gradient slices and parameter shards, the stream
synchronisation before the optimizer step. The oracle is the same model
trained with plain torch on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

from mpar.testing import run_distributed
from tests.multiproc._pipeline_cases import batch, loss_fn, make_optimizer, mixed_reference, mlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = {"CUDA_VISIBLE_DEVICES": "0"}
TOL = {"rtol": 1e-5, "atol": 1e-5}
ZERO = [
    {"stage": 1, "offload_optimizer": "cpu"},
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
]


def _train(config, steps, optimizer="adamw"):
    import mpar

    mpar.init(config)
    model = mpar.DistributedModel(mlp())
    opt = mpar.DistributedOptimizer(make_optimizer(optimizer, model.parameters()))

    @mpar.step
    def train(m, x, y):
        loss = loss_fn(m(x), y)
        m.backward(loss)
        return loss

    for s in range(steps):
        x, y = batch("mlp", s)
        train(model, x.cuda(), y.cuda())
        opt.step()
        opt.zero_grad()
    return {
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
        "report": mpar.memory_report(),
    }


def _reference(steps):
    net = mlp().cuda()
    opt = make_optimizer("adamw", net.parameters())
    for s in range(steps):
        x, y = batch("mlp", s)
        loss_fn(net(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("zero", ZERO, ids=lambda z: f"z{z['stage']}")
def test_offload_on_cuda_matches_plain_torch_on_the_gpu(zero):
    config = {"device": "cuda", "microbatches": 2, "zero": zero}
    (result,) = run_distributed(_train, 1, args=(config, 3), env=GPU, timeout=180)
    ref = _reference(3)
    for name, tensor in ref.items():
        torch.testing.assert_close(result["state"][name], tensor, **TOL, msg=name)
    cuda = next(row for device, row in result["report"].items() if device.startswith("cuda"))
    assert cuda["optimizer"] == 0  # optimizer state and masters live on the host
    assert result["report"]["cpu"]["optimizer"] > 0


def test_bf16_with_offload_on_cuda_follows_the_mixed_precision_recipe():
    """Against the recipe written out in plain torch (bf16 module, float32 masters),
    run on the CPU: GPU and CPU bf16 kernels round differently, hence the tolerance."""
    config = {"device": "cuda", "microbatches": 1, "bf16": True}
    config["zero"] = {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    (result,) = run_distributed(_train, 1, args=(config, 3, "sgd"), env=GPU, timeout=180)
    ref = mixed_reference("mlp", "sgd", 3, torch.bfloat16)
    for name, tensor in ref["state"].items():
        assert result["state"][name].dtype == torch.float32, name
        torch.testing.assert_close(result["state"][name], tensor, rtol=2e-2, atol=2e-3, msg=name)
