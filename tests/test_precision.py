"""labsim.precision: roofline times of a layer's GEMMs by dtype."""

from __future__ import annotations

import pytest

from labsim import Roofline, Transformer, gpu
from labsim.precision import layer_gemm_times


def test_large_layer_is_compute_bound_in_fp32_and_near_the_tensor_core_peak_in_bf16():
    model = Transformer.preset("gpt3-175b")
    t = layer_gemm_times(model, "H100-SXM", micro_batch=1)
    h100 = gpu("H100-SXM")
    flops = sum(g.flops for g in model.layer_gemms(1))
    # fp32's ridge (67 TFLOP/s / 3.35 TB/s = 20 FLOP/B) is below every GEMM's intensity
    assert t["fp32"] == pytest.approx(flops / h100.peak("fp32"))
    # bf16: the attention-score GEMMs (k = head_dim) fall below the 295 FLOP/B ridge
    assert flops / h100.peak("bf16") < t["bf16"] < 1.1 * flops / h100.peak("bf16")
    assert t["fp32"] / t["bf16"] > 13


def test_small_gemm_is_memory_bound_and_bytes_halve():
    model = Transformer(layers=1, hidden=64, heads=1, seq_len=8, vocab=16)
    t = layer_gemm_times(model, "A100-80GB", dtypes=("fp32", "bf16"))
    bw = Roofline.of("A100-80GB", "bf16").bandwidth_Bps
    nbytes = sum(g.nbytes(2) for g in model.layer_gemms(1))
    assert t["bf16"] == pytest.approx(nbytes / bw)
    assert t["fp32"] == pytest.approx(2 * t["bf16"])


def test_unknown_dtype_and_missing_unit_raise():
    model = Transformer.preset("gpt2-124m")
    with pytest.raises(ValueError):
        layer_gemm_times(model, "H100-SXM", dtypes=("fp12",))
    with pytest.raises(ValueError):
        layer_gemm_times(model, "V100-32GB", dtypes=("bf16",))


def test_points_sit_on_their_roof():
    from labsim.precision import layer_gemm_points

    model = Transformer.preset("llama2-7b")
    points = layer_gemm_points(model, "H100-SXM", dtypes=("fp32", "bf16"))
    assert len(points) == 2 * len(model.layer_gemms(1))
    for label, intensity, flops in points:
        roof = Roofline.of("H100-SXM", label.split()[0])
        assert flops == pytest.approx(min(roof.peak_flops, intensity * roof.bandwidth_Bps))
