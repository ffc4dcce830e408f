"""Bytes per token on the roofline: hand-computed decode costs and int8 speed-up bounds."""

from __future__ import annotations

import pytest

from labsim.hardware import gpu
from labsim.quantization import decode_cost, int8_decode_speedup, llama2_7b, matmul_cost
from labsim.workload import Transformer

TINY = Transformer(layers=1, hidden=64, heads=4, seq_len=16, vocab=100, bias=False,
                   norm="rmsnorm")  # 4*64^2 attention + 2*64*256 MLP + 2*64 norm = 49280


def test_decode_cost_by_hand() -> None:
    assert TINY.params_per_layer == 4 * 64 * 64 + 2 * 64 * 256 + 2 * 64
    c = decode_cost("A100-80GB", TINY, batch=4, context=10)
    assert c.flops == 2 * 49280 + 4 * 10 * 64
    assert c.weight_bytes == 49280 * 2 / 4
    assert c.kv_bytes == 2 * 10 * 64 * 2
    assert c.time_s == pytest.approx(c.nbytes / 2039e9)  # 1 FLOP/B: memory-bound
    assert c.bound == "memory"


def test_batch_one_no_context_gains_exactly_the_byte_ratio() -> None:
    for name in ("A100-80GB", "H100-SXM", "RTX-4090"):
        assert int8_decode_speedup(name, batch=1, context=0) == pytest.approx(2.0)
        assert int8_decode_speedup(name, batch=1, context=0, baseline="bf16") == pytest.approx(2)


def test_kv_cache_caps_the_gain() -> None:
    """With an fp16 KV cache of W bytes beside P fp16 weight bytes: (P + W) / (P/2 + W)."""
    m = llama2_7b()
    p, w = m.params_per_layer * 2.0, 2 * 4096 * m.kv_dim * 2.0
    expected = (p + w) / (p / 2 + w)
    assert int8_decode_speedup("H100-SXM", m, batch=1, context=4096) == pytest.approx(expected)
    gains = [int8_decode_speedup("H100-SXM", batch=b, context=1024) for b in (1, 8, 64, 512)]
    assert gains == sorted(gains, reverse=True) and gains[-1] < 1.05


def test_compute_bound_gain_is_the_ratio_of_peaks() -> None:
    h100 = gpu("H100-SXM")
    big = 1 << 20  # weights fully amortised: compute-bound for W8A8 and fp16 alike
    s = int8_decode_speedup(h100, batch=big, context=0, activations_int8=True)
    assert s == pytest.approx(h100.peak("int8") / h100.peak("fp16"))
    # weight-only int8 computes at the fp16 peak: no gain once compute-bound
    assert int8_decode_speedup(h100, batch=big, context=0) == pytest.approx(1.0)


def test_training_matmul_is_compute_bound() -> None:
    mm16 = matmul_cost("A100-80GB", 8192, 4096, 4096, dtype="fp16")
    assert mm16.flops == 2 * 8192 * 4096 * 4096
    assert mm16.nbytes == (8192 * 4096 + 4096 * 4096 + 8192 * 4096) * 2
    assert mm16.time_s == pytest.approx(mm16.flops / 312e12)
    mm8 = matmul_cost("A100-80GB", 8192, 4096, 4096, dtype="int8")
    assert mm8.nbytes == (8192 * 4096 + 4096 * 4096) * 1 + 8192 * 4096 * 4  # int32 out
    assert mm16.time_s / mm8.time_s == pytest.approx(2.0)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="batch"):
        decode_cost("H100-SXM", batch=0)
    with pytest.raises(ValueError, match="dtype"):
        decode_cost("H100-SXM", weights="int3")
    with pytest.raises(ValueError, match="no fp8"):
        decode_cost("A100-80GB", compute="fp8")
    with pytest.raises(ValueError, match="m, n and k"):
        matmul_cost("H100-SXM", 0, 1, 1)
