"""labsim.experiments.checkpointing: segments, the planner against exhaustive search, measurement.

labsim.experiments.checkpointing: int8 saved activations, size and error.

labsim.experiments.checkpointing: what a step executes, counted; plans timed in interleaved
rounds and set against their counts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.checkpointing import every_k, recomputed_layers, segment_peak_bytes, sqrt_segments
from labsim.checks.checkpointing import _best_recompute, forward_segments, plan_segments
from labsim.experiments.checkpointing import (
    ExtraTime,
    block_bytes,
    combine,
    count_step,
    dequantize_rows,
    int8_gradients,
    int8_saved_activations,
    measure_memory,
    measure_plans,
    measure_step,
    quantize_rows,
    time_overhead,
    time_plans,
)
from labsim.lab.device import Timing
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


def test_counts_see_early_stop_and_what_flop_counting_leaves_out(net):
    blocks, x = net
    plain = count_step(forward_segments, blocks, x, [0])
    every = count_step(forward_segments, blocks, x, every_k(L, 1))
    # L - 1 recomputed blocks rerun one of their two matmuls (early stop skips the second):
    # (L - 1) / (6 L) of the step's matmul FLOPs (forward 2 matmuls, backward 4)
    assert every.flops / plain.flops - 1 == pytest.approx((L - 1) / (6 * L))
    added = every.extra_ops(plain)
    for op in ("aten::addmm", "aten::native_layer_norm", "aten::gelu"):
        assert added[op] == L - 1
    assert added["aten::detach"] > 3 * (L - 1)  # the saved-tensor hooks' bookkeeping
    assert list(added)[0] == "aten::detach"  # most added first
    assert plain.extra_ops(plain) == {}


def test_memory_alone_matches_the_instrumented_step(net):
    blocks, x = net
    for starts in ([0], every_k(L, 1)):
        m = measure_memory(forward_segments, blocks, x, starts, label="p")
        s = measure_step(forward_segments, blocks, x, starts, repeat=1)
        assert (m.saved_bytes, m.peak_bytes) == (s.saved_bytes, s.peak_bytes)
        assert m.label == "p" and "saved" in repr(m)


def test_plans_are_timed_in_the_same_rounds_and_combined(net):
    blocks, x = net
    plans = {"none": [0], "every layer": every_k(L, 1)}
    t = time_plans(forward_segments, blocks, x, plans, rounds=3)
    assert set(t) == set(plans) and all(len(v.times_s) == 3 for v in t.values())
    steps = measure_plans(forward_segments, blocks, x, plans, rounds=2)
    assert [s.label for s in steps] == list(plans) and all(s.step_s > 0 for s in steps)
    assert all(p.grad is None for p in blocks.parameters())  # the plans leave no gradients


def _timings(*rows):
    return {k: Timing(tuple(v)) for k, v in rows}


def test_overhead_rows_read_the_rounds_and_say_when_they_disagree():
    counts = {"none": type("C", (), {"flops": 100})(), "every": type("C", (), {"flops": 116})()}
    large = _timings(("none", [1.0, 1.1, 1.0, 1.2, 1.0]), ("every", [2.0, 2.2, 2.1, 2.3, 2.0]))
    small = _timings(("none", [0.1] * 5), ("every", [0.3, 0.31, 0.29, 0.3, 0.32]))
    (row,) = time_overhead(small, large, counts, small_tokens=8, large_tokens=256)
    assert row.settled and row.flops_added == pytest.approx(0.16)
    assert row.extra_large.median_s == pytest.approx(1.1) and row.extra_small.median_s == (
        pytest.approx(0.2))
    assert "adds 1100.0 ms" in repr(row) and "+16.0%" in repr(row)
    noisy = _timings(("none", [1.0, 2.0, 1.0, 2.0, 1.0]), ("every", [2.0, 1.0, 2.0, 1.0, 1.1]))
    (row,) = time_overhead(small, noisy, counts, small_tokens=8, large_tokens=256)
    assert not row.settled and "too noisy to tell" in repr(row)
    assert "adds" not in repr(row).split("8 tokens")[0]  # no number where there is no verdict
    assert ExtraTime.of(large, "none", "every").low_s <= 1.1 <= ExtraTime.of(
        large, "none", "every").high_s


def test_combine_keeps_the_plans_measured_both_ways(net):
    blocks, x = net
    mem = {"a": measure_memory(forward_segments, blocks, x, [0], label="a")}
    got = combine(mem, _timings(("a", [0.5, 0.7, 0.6]), ("b", [1.0])))
    assert len(got) == 1 and got[0].step_s == pytest.approx(0.6)


def test_int8_gradients_report_size_and_error(small_net):
    blocks, x = small_net
    got = int8_gradients(forward_segments, blocks, x)
    assert 0 < got.rel_error < 0.05 and got.cosine > 0.99
    assert got.stats.raw_bytes > got.stats.stored_bytes > 0
    assert all(p.grad is None for p in blocks.parameters())
