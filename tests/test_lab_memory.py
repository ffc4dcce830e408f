"""The memory meter, on the CPU: exact saved-for-backward bytes of small known graphs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labsim.lab.memory import (
    MemoryMeter,
    grad_bytes,
    optimizer_state_bytes,
    param_bytes,
    saved_activation_bytes,
    tensor_bytes,
)


def test_linear_saves_its_input_not_its_weight() -> None:
    layer = nn.Linear(100, 50, bias=False)
    x = torch.randn(32, 100)
    # the weight gradient needs x (32 x 100 fp32); the weight itself is a parameter
    assert saved_activation_bytes(layer, x, model=layer) == 32 * 100 * 4
    # x needs no gradient, so the weight (for dL/dx) is not even saved
    assert saved_activation_bytes(layer, x) == 32 * 100 * 4
    # when the input needs a gradient, autograd saves the weight too: a parameter, counted
    # only when the meter does not know the model
    x.requires_grad_(True)
    assert saved_activation_bytes(layer, x) == 32 * 100 * 4 + 50 * 100 * 4
    assert saved_activation_bytes(layer, x, model=layer) == 32 * 100 * 4


def test_mlp_dedups_shared_storage() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(8, 64)
    # x for the first weight; ReLU's output serves both ReLU's backward and the second
    # linear's weight gradient: one storage, counted once.
    assert saved_activation_bytes(mlp, x, model=mlp) == (8 * 64 + 8 * 256) * 4


def test_nothing_saved_without_grad() -> None:
    layer = nn.Linear(10, 10)
    with torch.no_grad():
        assert saved_activation_bytes(layer, torch.randn(4, 10), model=layer) == 0


def test_breakdown_through_a_training_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    with MemoryMeter(model, opt) as meter:
        before = meter.breakdown()
        loss = model(torch.randn(16, 32)).square().mean()
    assert before.grads == 0 and before.optimizer == 0  # Adam's state is created lazily
    loss.backward()
    opt.step()
    mem = meter.breakdown()
    assert mem.params == 4 * n
    assert mem.grads == 4 * n
    # exp_avg + exp_avg_sq (4 B each per parameter) + one fp32 step count per tensor
    assert mem.optimizer == 8 * n + 4 * len(list(model.parameters()))
    assert mem.activations == meter.saved_bytes > 0
    assert meter.peak_bytes is None  # the CPU allocator keeps no peak statistic
    assert "saved_bytes" in repr(meter)


def test_tied_weights_counted_once() -> None:
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = nn.ModuleList([emb, head])
    assert param_bytes(model) == 100 * 16 * 4
    assert grad_bytes(model) == 0


def test_tensor_bytes_views_and_none() -> None:
    base = torch.zeros(10, 10)
    assert tensor_bytes([base, base[2:5], base.t(), None]) == 400
    assert tensor_bytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2)]) == 6 + 8


def test_sgd_without_momentum_has_no_state() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert optimizer_state_bytes(opt) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_covers_saved_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    x = torch.randn(512, 1024, device="cuda")
    with MemoryMeter(model) as meter:
        y = model(x)
    assert meter.peak_bytes is not None
    # the block allocated at least what it saved for backward (minus the input x, which
    # existed before) plus its output
    assert meter.peak_bytes >= meter.saved_bytes - x.numel() * 4 + y.numel() * 4
