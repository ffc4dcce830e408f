"""labsim.experiments.checkpointing: segments, the planner against exhaustive search, measurement.

labsim.experiments.checkpointing: int8 saved activations, size and error.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.checkpointing import every_k, recomputed_layers, segment_peak_bytes, sqrt_segments
from labsim.checks.checkpointing import _best_recompute, forward_segments, plan_segments
from labsim.experiments.checkpointing import (
    block_bytes,
    dequantize_rows,
    int8_saved_activations,
    measure_step,
    quantize_rows,
)
from labsim.lab.models import residual_mlp

L, W, T = 6, 16, 64


@pytest.fixture(scope="module")
def net():
    x = torch.randn(T, W, generator=torch.Generator().manual_seed(2))
    return residual_mlp(L, W, seed=1), x


def _grads(blocks, x, starts):
    blocks.zero_grad(set_to_none=True)
    out = forward_segments(blocks, x, starts)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in blocks.parameters()]


@pytest.mark.parametrize("starts", [None, [0], [0, 1, 2, 3, 4, 5], [0, 2, 4], [0, 5], [0, 1, 4]])
def test_checkpointing_changes_nothing_but_memory(net, starts):
    blocks, x = net
    ref_out, ref_grads = _grads(blocks, x, None)
    out, grads = _grads(blocks, x, starts)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-8)


def test_saved_bytes_match_the_count_of_block_bytes(net):
    blocks, x = net
    per_block, boundary = block_bytes(W, T)
    out_bytes = T * W * 4  # mean(out**2) saves out
    plain = measure_step(forward_segments, blocks, x, None, repeat=1)
    assert plain.saved_bytes == L * per_block + out_bytes
    every = measure_step(forward_segments, blocks, x, every_k(L, 1), repeat=1)
    # every segment but the last keeps its input; the last layer runs normally
    assert every.saved_bytes == (L - 1) * boundary + per_block + out_bytes


def test_measured_peak_follows_the_segment_model(net):
    blocks, x = net
    per_block, boundary = block_bytes(W, T)
    grads = sum(p.numel() * 4 for p in blocks.parameters())
    for starts in ([0], every_k(L, 1), [0, 3], [0, 2, 4]):
        m = measure_step(forward_segments, blocks, x, starts, repeat=1)
        model = segment_peak_bytes([per_block] * L, [boundary] * L, starts)
        assert model <= m.peak_bytes <= model + grads + 4 * T * W * 4


def test_segment_model_and_recompute_count():
    assert segment_peak_bytes([10] * 4, [1] * 4, [0]) == 40
    assert segment_peak_bytes([10] * 4, [1] * 4, [0, 1, 2, 3]) == 13
    assert segment_peak_bytes([10] * 4, [1] * 4, [0, 2]) == 21
    assert recomputed_layers(4, [0]) == 0
    assert recomputed_layers(4, [0, 2]) == 2
    assert sqrt_segments(16) == [0, 4, 8, 12]
    with pytest.raises(ValueError):
        segment_peak_bytes([1, 1], [1, 1], [1])
    with pytest.raises(ValueError):
        segment_peak_bytes([1, 1], [1, 1], [0, 0])


@settings(max_examples=60, deadline=None)
@given(
    layers=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    data=st.data(),
)
def test_planner_matches_exhaustive_search(layers, data):
    inputs = data.draw(st.lists(st.integers(0, 5), min_size=len(layers), max_size=len(layers)))
    budget = data.draw(st.integers(1, sum(layers) + 5))
    best = _best_recompute(layers, inputs, budget)
    if best is None:
        with pytest.raises(ValueError):
            plan_segments(layers, inputs, budget)
        return
    starts = plan_segments(layers, inputs, budget)
    assert segment_peak_bytes(layers, inputs, starts) <= budget
    assert recomputed_layers(len(layers), starts) == best


@pytest.fixture(scope="module")
def small_net():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    return residual_mlp(6, 16, seed=1), x


def _grads(blocks, x, starts):
    blocks.zero_grad(set_to_none=True)
    out = forward_segments(blocks, x, starts)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in blocks.parameters()]


def test_int8_compression_is_about_4x_smaller_with_bounded_error(small_net):
    blocks, x = small_net
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
