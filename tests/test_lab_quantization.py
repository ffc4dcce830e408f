"""The reference int8 quantization: exact hand cases and oracles (float64 on dequantized
values, int64 matmul)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from labsim.lab import quantization as q8


def test_qparams_by_hand() -> None:
    s, z = q8.affine_qparams(torch.tensor(-1.0), torch.tensor(3.0))
    assert s.item() == pytest.approx(4 / 255) and z.item() == -128 + 64  # round(-1/(4/255))=-64
    s, z = q8.affine_qparams(torch.tensor(-1.0), torch.tensor(2.0), symmetric=True)
    assert s.item() == pytest.approx(2 / 127) and z.item() == 0
    s, z = q8.affine_qparams(torch.tensor(2.0), torch.tensor(5.0))  # widened to [0, 5]
    assert s.item() == pytest.approx(5 / 255) and z.item() == -128
    s, z = q8.affine_qparams(torch.tensor(0.0), torch.tensor(0.0))
    assert s.item() == q8.EPS and z.dtype == torch.int32


def test_zero_is_exact_and_codes_are_int8() -> None:
    s, z = q8.affine_qparams(torch.tensor(-0.3), torch.tensor(7.1))
    q = q8.quantize(torch.tensor([0.0, -0.3, 7.1]), s, z)
    assert q.dtype == torch.int8
    assert q.tolist()[1:] == [-128, 127]
    assert q8.dequantize(q, s, z)[0].item() == 0.0


@settings(max_examples=40, deadline=None)
@given(st.floats(-100, -1e-3), st.floats(1e-3, 100), st.booleans(), st.integers(0, 2**31))
def test_round_trip_error_is_at_most_half_a_step(lo: float, hi: float, sym: bool, seed: int
                                                 ) -> None:
    s, z = q8.affine_qparams(torch.tensor(lo), torch.tensor(hi), symmetric=sym)
    x = torch.rand(256, generator=torch.Generator().manual_seed(seed)) * (hi - lo) + lo
    err = (q8.dequantize(q8.quantize(x, s, z), s, z) - x).abs().max().item()
    assert err <= s.item() / 2 * (1 + 1e-5) + 1e-6


def test_per_channel_beats_per_tensor_on_an_outlier_row() -> None:
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 0.05
    w[2] *= 100
    errs = []
    for per_channel in (False, True):
        w_q, s = q8.quantize_weight(w, per_channel)
        axis = 0 if per_channel else None
        back = q8.dequantize(w_q, s, torch.zeros((), dtype=torch.int32), axis)
        others = torch.arange(8) != 2
        errs.append(((back - w)[others] ** 2).mean().item())
    assert errs[1] < errs[0] / 1000  # the small rows get a step 100x finer


def test_observers() -> None:
    x = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    mm = q8.MinMaxObserver()
    mm.observe(x)
    mm.observe(x * 2)
    assert [v.item() for v in mm.range()] == [-4.0, 6.0]
    per = q8.MinMaxObserver(axis=1)
    per.observe(x)
    assert per.range()[0].tolist() == [1.0, -2.0] and per.range()[1].tolist() == [3.0, 0.5]
    pct = q8.PercentileObserver(100.0)
    pct.observe(x)
    assert [v.item() for v in pct.range()] == [-2.0, 3.0]
    with pytest.raises(ValueError, match="observe"):
        q8.PercentileObserver().range()
    with pytest.raises(ValueError, match="percentile"):
        q8.PercentileObserver(40)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 70), st.integers(1, 5), st.integers(-128, 127),
       st.integers(0, 2**31))
def test_int8_matmul_equals_int64(n: int, k: int, m: int, zp: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    got = q8.int8_matmul(xq, wq, torch.tensor(zp))
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), (xq.long() - zp) @ wq.long().T)


def test_int8_linear_equals_float_math_on_dequantized_values() -> None:
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(6, 20, generator=g), torch.randn(5, 20, generator=g), torch.randn(6)
    w_q, w_s = q8.quantize_weight(w, per_channel=True)
    x_s, x_z = q8.affine_qparams(x.min(), x.max())
    got = q8.int8_linear(x, w_q, w_s, x_s, x_z, b)
    xd = q8.dequantize(q8.quantize(x, x_s, x_z), x_s, x_z).double()
    wd = (w_q.double() * w_s.double()[:, None])
    assert torch.allclose(got.double(), xd @ wd.T + b.double(), rtol=1e-5, atol=1e-5)


def small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_quantize_model_calibrates_and_replaces() -> None:
    model = small_mlp()
    before = [p.clone() for p in model.parameters()]
    calib = [torch.randn(32, 8, generator=torch.Generator().manual_seed(2))]
    qm = q8.quantize_model(model, calib, per_channel=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any(isinstance(m, nn.Linear) for m in qm.modules())
    first = qm[0]
    assert isinstance(first, q8.Int8Linear) and first.w_scale.ndim == 0
    s, z = q8.affine_qparams(calib[0].min(), calib[0].max())
    assert first.x_scale == s and first.x_zero_point == z
    x = calib[0][:4]
    assert torch.allclose(qm(x), model(x), atol=0.05)
    dyn = q8.quantize_model(model, None)
    assert dyn[0].x_scale is None and torch.allclose(dyn(x), model(x), atol=0.05)
    wo = q8.quantize_model(model, calib, weight_only=True)
    assert wo[0].x_scale is None and torch.allclose(wo(x), model(x), atol=0.02)


def test_int8_linear_module_validation_and_size() -> None:
    with pytest.raises(ValueError, match="int8"):
        q8.Int8Linear(torch.zeros(2, 2), torch.tensor(1.0), None, None, None)
    with pytest.raises(ValueError, match="both"):
        q8.Int8Linear(torch.zeros(2, 2, dtype=torch.int8), torch.tensor(1.0), torch.tensor(1.0),
                      None, None)
    model = small_mlp()
    qm = q8.quantize_model(model, [torch.randn(4, 8)])
    # int8 weights (8*16 + 16*4) + fp32 biases, per-channel scales, x scales and int32 zps
    expected = (8 * 16 + 16 * 4) + 4 * (16 + 4) + 4 * (16 + 4) + 2 * (4 + 4)
    assert q8.model_nbytes(qm) == expected
    assert q8.model_nbytes(model) == 4 * (8 * 16 + 16 + 16 * 4 + 4)
