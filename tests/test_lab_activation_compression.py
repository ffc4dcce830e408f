"""labsim.lab.activation_compression: int8 saved activations, size and error."""

from __future__ import annotations

import pytest
import torch

from labsim.lab.activation_compression import (
    dequantize_rows,
    int8_saved_activations,
    quantize_rows,
)
from labsim.lab.checkpointing import forward_segments, residual_mlp


@pytest.fixture(scope="module")
def net():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    return residual_mlp(6, 16, seed=1), x


def _grads(blocks, x, starts):
    blocks.zero_grad(set_to_none=True)
    out = forward_segments(blocks, x, starts)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in blocks.parameters()]


def test_int8_compression_is_about_4x_smaller_with_bounded_error(net):
    blocks, x = net
    params = list(blocks.parameters())
    _, ref = _grads(blocks, x, None)
    blocks.zero_grad(set_to_none=True)
    with int8_saved_activations(params, min_numel=1) as stats:
        loss = forward_segments(blocks, x, None).square().mean()
    loss.backward()
    assert 3.0 < stats.ratio <= 4.0
    num = sum((p.grad - r).square().sum() for p, r in zip(params, ref)).sqrt()
    den = sum(r.square().sum() for r in ref).sqrt()
    assert 0 < (num / den).item() < 0.05


def test_quantize_rows_error_is_at_most_half_a_step():
    t = torch.randn(8, 33, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_rows(t)
    back = dequantize_rows(q, scale, t)
    assert q.dtype == torch.int8 and back.shape == t.shape
    assert ((back - t).abs() <= scale / 2 + 1e-7).all()
