"""The int8 checks pass the solutions, fail a stub or the reference, and catch the typical bugs.

The reference int8 quantization: exact hand cases and oracles (float64 on dequantized
values, int64 matmul).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from labsim.checks import CheckFailed
from labsim.checks import quantization as chk
from labsim.checks.quantization.reference import (
    EPS,
    Int8Linear,
    MinMaxObserver,
    PercentileObserver,
    affine_qparams,
    dequantize,
    int8_linear,
    int8_matmul,
    model_nbytes,
    quantize,
    quantize_model,
    quantize_multiplier,
    quantize_weight,
    requantize,
)

from .solution_cells import exercises

S = exercises("12_int8_quantization")


def stub(*args: object, **kwargs: object) -> None:
    raise NotImplementedError


class StubObserver:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def observe(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def range(self) -> None:
        raise NotImplementedError


def test_solutions_pass(capsys: pytest.CaptureFixture[str]) -> None:
    chk.affine_qparams(S["affine_qparams"])
    chk.quantize_dequantize(S["quantize"], S["dequantize"])
    chk.minmax_observer(S["MinMaxObserver"])
    chk.percentile_observer(S["PercentileObserver"])
    chk.int8_matmul(S["int8_matmul"])
    chk.int8_linear(S["int8_linear"])
    chk.quantize_model(S["quantize_model"])
    chk.quantize_multiplier(S["quantize_multiplier"])
    chk.requantize(S["requantize"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and all(line.startswith("PASS ") for line in lines)


@pytest.mark.parametrize("run", [
    lambda: chk.affine_qparams(affine_qparams),
    lambda: chk.quantize_dequantize(quantize, dequantize),
    lambda: chk.minmax_observer(MinMaxObserver),
    lambda: chk.percentile_observer(PercentileObserver),
    lambda: chk.int8_matmul(int8_matmul),
    lambda: chk.int8_linear(lambda *a: int8_linear(*a)),
    lambda: chk.quantize_model(lambda *a, **k: quantize_model(*a, **k)),
    lambda: chk.quantize_multiplier(quantize_multiplier),
    lambda: chk.requantize(lambda *a: requantize(*a)),
], ids=["qparams", "qdq", "minmax", "percentile", "matmul", "linear", "model", "multiplier",
        "requantize"])
def test_the_reference_or_a_wrapper_of_it_fails(run) -> None:
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        run()


def test_a_model_left_with_the_shells_default_reference_linear_fails() -> None:
    def default_linear_fn(model, calibration, *, per_channel=True, observer=None):
        qm = S["quantize_model"](model, calibration, per_channel=per_channel,
                                  observer=observer)
        for m in qm.modules():
            if isinstance(m, Int8Linear):
                m.linear_fn = int8_linear  # the shell's default: the reference
        return qm

    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        chk.quantize_model(default_linear_fn)


@pytest.mark.parametrize("run", [
    lambda: chk.affine_qparams(stub),
    lambda: chk.quantize_dequantize(stub, stub),
    lambda: chk.minmax_observer(StubObserver),
    lambda: chk.percentile_observer(StubObserver),
    lambda: chk.int8_matmul(stub),
    lambda: chk.int8_linear(stub),
    lambda: chk.quantize_model(stub),
    lambda: chk.quantize_multiplier(stub),
    lambda: chk.requantize(stub),
])
def test_stubs_fail(run) -> None:
    with pytest.raises(CheckFailed, match=r"FAIL \w+: 0/\d+ cases passed"):
        run()


def test_catches_a_zero_point_not_widened_to_include_zero() -> None:
    def no_widening(lo, hi, symmetric=False):
        if symmetric:
            return S["affine_qparams"](lo, hi, symmetric)
        lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
        scale = (hi - lo) / 255
        return scale, (-128 - torch.round(lo / scale)).to(torch.int32)

    with pytest.raises(CheckFailed, match="positive-only"):
        chk.affine_qparams(no_widening)


def test_catches_truncation_instead_of_rounding() -> None:
    def truncating(x, scale, zero_point, axis=None):
        return (x / scale + zero_point).clamp(-128, 127).to(torch.int8)

    with pytest.raises(CheckFailed, match="tiny tensor"):
        chk.quantize_dequantize(truncating, S["dequantize"])


def test_catches_an_int64_accumulator() -> None:
    def int64_acc(x_q, w_q, zp):
        return (x_q.long() - int(zp)) @ w_q.long().T

    with pytest.raises(CheckFailed, match="int32"):
        chk.int8_matmul(int64_acc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_float_matmul_breaks_the_integer_rule_even_when_exact(dtype) -> None:
    def float_acc(x_q, w_q, zp):
        return ((x_q.to(dtype) - float(zp)) @ w_q.to(dtype).T).round().to(torch.int32)

    with pytest.raises(CheckFailed, match="computes in floating point") as info:
        chk.int8_matmul(float_acc)
    assert "0/6 cases passed" in str(info.value)


def test_int8_linear_with_a_float_matmul_breaks_the_rule() -> None:
    def float_linear(x, w_q, w_scale, x_scale, x_zero_point, bias=None):
        q = S["quantize"](x, x_scale, x_zero_point).double() - float(x_zero_point)
        y = (q @ w_q.double().T).float() * (x_scale * w_scale)
        return y if bias is None else y + bias

    with pytest.raises(CheckFailed, match="its matmul multiplies float64"):
        chk.int8_linear(float_linear)


# -- numpy and Python numbers: the integer rules hold whatever computes ------------------------

def _np_float64_matmul(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    x = np.asarray(x_q, dtype=np.float64) - float(zp)
    return torch.from_numpy(np.rint(x @ np.asarray(w_q, dtype=np.float64).T).astype(np.int32))


def _np_array_matmul(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    x, w = np.array(x_q).astype(np.float64), np.array(w_q).astype(np.float64)
    return torch.tensor((x - int(zp)) @ w.T, dtype=torch.int32)


def _np_ufunc_on_tensors(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    acc = np.matmul(x_q, w_q.T, dtype=np.float64)  # numpy reads the tensors it is handed
    return torch.as_tensor(acc).to(torch.int32) - int(zp) * w_q.sum(1, dtype=torch.int32)


def _np_einsum_on_tensors(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    acc = np.einsum("nk,mk->nm", x_q, w_q, dtype=np.float64)  # numpy's Python code between
    return torch.from_numpy(acc.astype(np.int32)) - int(zp) * w_q.sum(1, dtype=torch.int32)


def _np_from_dlpack(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    x = np.from_dlpack(x_q).astype(np.float64) - int(zp)
    return torch.from_numpy((x @ np.from_dlpack(w_q).astype(np.float64).T).astype(np.int32))


def _numpy_method(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    x = x_q.numpy().astype(np.float64) - int(zp)
    return torch.from_numpy((x @ w_q.numpy().astype(np.float64).T).astype(np.int32))


def _python_numbers(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    """Each code read as a Python int, the products taken by numpy in float64."""
    x = np.array([[int(v) for v in row] for row in x_q], dtype=np.float64) - int(zp)
    w = np.array([[int(v) for v in row] for row in w_q], dtype=np.float64)
    return torch.tensor(x @ w.T, dtype=torch.int32)


def _python_floats(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    rows = [[sum((float(a) - float(zp)) * float(b) for a, b in zip(xr, wr)) for wr in w_q]
            for xr in x_q]
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize(("fn", "why"), [
    (_np_float64_matmul, r"`Tensor.__array__`, which numpy calls"),
    (_np_array_matmul, r"`Tensor.__array__`, which numpy calls"),
    (_np_ufunc_on_tensors, r"`Tensor.__array__`, which numpy calls"),
    (_np_einsum_on_tensors, r"`Tensor.__array__`, which numpy calls"),
    (_np_from_dlpack, r"`Tensor.__dlpack__`, which numpy calls"),
    (_numpy_method, r"`Tensor.numpy`"),
    (_python_numbers, "torch computed no integer products"),
    (_python_floats, r"computes in floating point \(Python float\)"),
], ids=["np.asarray", "np.array", "np.matmul on tensors", "np.einsum on tensors",
        "np.from_dlpack", ".numpy()", "python ints into numpy", "python floats"])
@pytest.mark.filterwarnings("ignore:__array:DeprecationWarning")  # numpy 2 on a torch tensor
def test_int8_matmul_outside_torch_fails(fn, why: str) -> None:  # type: ignore[no-untyped-def]
    x, w = torch.randint(-128, 128, (3, 5), dtype=torch.int8), torch.randint(
        -128, 128, (4, 5), dtype=torch.int8)
    assert torch.equal(fn(x, w, torch.tensor(3)), S["int8_matmul"](x, w, torch.tensor(3)))
    with pytest.raises(CheckFailed, match=f"(?s)0/6 cases passed.*{why}"):
        chk.int8_matmul(fn)


def _torch_int32(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    return (x_q.to(torch.int32) - int(zp)) @ w_q.to(torch.int32).T


def _torch_int_mm(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    acc = torch._int_mm(x_q, w_q.T.contiguous())  # int8 x int8 -> int32 (oneDNN on a CPU)
    return acc - int(zp) * w_q.sum(dim=1, dtype=torch.int32)


def _products_summed(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    x = x_q.to(torch.int32) - int(zp)
    return (x[:, None, :] * w_q.to(torch.int32)[None, :, :]).sum(-1, dtype=torch.int32)


def _einsum_int64(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    return torch.einsum("nk,mk->nm", x_q.long() - int(zp), w_q.long()).to(torch.int32)


def _printing(x_q, w_q, zp):  # type: ignore[no-untyped-def]
    acc = _torch_int32(x_q, w_q, zp)
    print(acc)  # torch formats the tensor itself (tolist inside torch): not the learner's
    return acc


@pytest.mark.parametrize("fn", [_torch_int32, _torch_int_mm, _products_summed, _einsum_int64,
                                _printing],
                         ids=["int32 matmul", "torch._int_mm", "products summed",
                              "int64 einsum", "printing a tensor"])
def test_honest_integer_matmuls_pass(fn, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore
    chk.int8_matmul(fn)
    assert capsys.readouterr().out.splitlines()[-1] == "PASS int8_matmul: 6/6 cases passed"


def _np_fake_quant_linear(x, w_q, w_scale, x_scale, x_zero_point, bias=None):  # type: ignore
    """Quantize with the learner's function, then the matmul as numpy fake quantization."""
    xq = S["quantize"](x, x_scale, x_zero_point)
    xd = np.asarray(xq, dtype=np.float64) - int(x_zero_point)
    y = torch.from_numpy(xd @ np.asarray(w_q, dtype=np.float64).T).float() * (x_scale * w_scale)
    return y if bias is None else y + bias


def _np_dequantized_linear(x, w_q, w_scale, x_scale, x_zero_point, bias=None):  # type: ignore
    xq = S["quantize"](x, x_scale, x_zero_point)
    xd = S["dequantize"](xq, x_scale, x_zero_point)
    wd = S["dequantize"](w_q, w_scale, torch.zeros_like(w_scale, dtype=torch.int32),
                         axis=0 if w_scale.ndim else None)
    y = torch.from_numpy(np.array(xd) @ np.array(wd).T)
    return y if bias is None else y + bias


@pytest.mark.parametrize("fn", [_np_fake_quant_linear, _np_dequantized_linear],
                         ids=["numpy fake quant", "numpy on dequantized values"])
@pytest.mark.filterwarnings("ignore:__array:DeprecationWarning")  # numpy 2 on a torch tensor
def test_int8_linear_in_numpy_fails(fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckFailed, match="(?s)0/5 cases passed.*`Tensor.__array__`"):
        chk.int8_linear(fn)


def _linear_with(matmul):  # type: ignore[no-untyped-def]
    def linear(x, w_q, w_scale, x_scale, x_zero_point, bias=None):  # type: ignore
        acc = matmul(S["quantize"](x, x_scale, x_zero_point), w_q, x_zero_point)
        y = acc.to(torch.float32) * (x_scale * w_scale)
        return y if bias is None else y + bias

    return linear


@pytest.mark.parametrize("matmul", [_torch_int32, _torch_int_mm, _products_summed],
                         ids=["int32 matmul", "torch._int_mm", "products summed"])
def test_honest_int8_linears_pass(matmul, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore
    chk.int8_linear(_linear_with(matmul))
    assert capsys.readouterr().out == "PASS int8_linear: 5/5 cases passed\n"


def test_catches_a_missing_zero_point_in_the_linear_layer() -> None:
    def no_zp(x, w_q, w_scale, x_scale, x_zero_point, bias=None):
        acc = S["int8_matmul"](S["quantize"](x, x_scale, x_zero_point), w_q, 0)
        y = acc.float() * (x_scale * w_scale)
        return y if bias is None else y + bias

    with pytest.raises(CheckFailed):
        chk.int8_linear(no_zp)


def test_catches_a_model_quantized_in_place_or_ignoring_per_channel() -> None:
    def in_place(model, calibration, *, per_channel=True, observer=None):
        quantized = S["quantize_model"](model, calibration, per_channel=per_channel,
                                         observer=observer)
        for name, module in quantized.named_children():
            model.add_module(name, module)  # the caller's model is changed
        return quantized

    with pytest.raises(CheckFailed, match="unchanged"):
        chk.quantize_model(in_place)

    def always_per_channel(model, calibration, *, per_channel=True, observer=None):
        return S["quantize_model"](model, calibration, per_channel=True, observer=observer)

    with pytest.raises(CheckFailed, match="per-tensor"):
        chk.quantize_model(always_per_channel)


def test_catches_a_percentile_that_is_a_min_max() -> None:
    class MinMaxPretendingPercentile(S["MinMaxObserver"]):
        def __init__(self, percentile: float = 99.99) -> None:
            super().__init__()

    with pytest.raises(CheckFailed, match="percentile 99.0"):
        chk.percentile_observer(MinMaxPretendingPercentile)


def test_qparams_by_hand() -> None:
    s, z = affine_qparams(torch.tensor(-1.0), torch.tensor(3.0))
    assert s.item() == pytest.approx(4 / 255) and z.item() == -128 + 64  # round(-1/(4/255))=-64
    s, z = affine_qparams(torch.tensor(-1.0), torch.tensor(2.0), symmetric=True)
    assert s.item() == pytest.approx(2 / 127) and z.item() == 0
    s, z = affine_qparams(torch.tensor(2.0), torch.tensor(5.0))  # widened to [0, 5]
    assert s.item() == pytest.approx(5 / 255) and z.item() == -128
    s, z = affine_qparams(torch.tensor(0.0), torch.tensor(0.0))
    assert s.item() == EPS and z.dtype == torch.int32


def test_zero_is_exact_and_codes_are_int8() -> None:
    s, z = affine_qparams(torch.tensor(-0.3), torch.tensor(7.1))
    q = quantize(torch.tensor([0.0, -0.3, 7.1]), s, z)
    assert q.dtype == torch.int8
    assert q.tolist()[1:] == [-128, 127]
    assert dequantize(q, s, z)[0].item() == 0.0


@settings(max_examples=40, deadline=None)
@given(st.floats(-100, -1e-3), st.floats(1e-3, 100), st.booleans(), st.integers(0, 2**31))
def test_round_trip_error_is_at_most_half_a_step(lo: float, hi: float, sym: bool, seed: int
                                                 ) -> None:
    s, z = affine_qparams(torch.tensor(lo), torch.tensor(hi), symmetric=sym)
    x = torch.rand(256, generator=torch.Generator().manual_seed(seed)) * (hi - lo) + lo
    err = (dequantize(quantize(x, s, z), s, z) - x).abs().max().item()
    assert err <= s.item() / 2 * (1 + 1e-5) + 1e-6


def test_per_channel_beats_per_tensor_on_an_outlier_row() -> None:
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 0.05
    w[2] *= 100
    errs = []
    for per_channel in (False, True):
        w_q, s = quantize_weight(w, per_channel)
        axis = 0 if per_channel else None
        back = dequantize(w_q, s, torch.zeros((), dtype=torch.int32), axis)
        others = torch.arange(8) != 2
        errs.append(((back - w)[others] ** 2).mean().item())
    assert errs[1] < errs[0] / 1000  # the small rows get a step 100x finer


def test_observers() -> None:
    x = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    mm = MinMaxObserver()
    mm.observe(x)
    mm.observe(x * 2)
    assert [v.item() for v in mm.range()] == [-4.0, 6.0]
    per = MinMaxObserver(axis=1)
    per.observe(x)
    assert per.range()[0].tolist() == [1.0, -2.0] and per.range()[1].tolist() == [3.0, 0.5]
    pct = PercentileObserver(100.0)
    pct.observe(x)
    assert [v.item() for v in pct.range()] == [-2.0, 3.0]
    with pytest.raises(ValueError, match="observe"):
        PercentileObserver().range()
    with pytest.raises(ValueError, match="percentile"):
        PercentileObserver(40)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 70), st.integers(1, 5), st.integers(-128, 127),
       st.integers(0, 2**31))
def test_int8_matmul_equals_int64(n: int, k: int, m: int, zp: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    got = int8_matmul(xq, wq, torch.tensor(zp))
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), (xq.long() - zp) @ wq.long().T)


def test_int8_linear_equals_float_math_on_dequantized_values() -> None:
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(6, 20, generator=g), torch.randn(5, 20, generator=g), torch.randn(6)
    w_q, w_s = quantize_weight(w, per_channel=True)
    x_s, x_z = affine_qparams(x.min(), x.max())
    got = int8_linear(x, w_q, w_s, x_s, x_z, b)
    xd = dequantize(quantize(x, x_s, x_z), x_s, x_z).double()
    wd = (w_q.double() * w_s.double()[:, None])
    assert torch.allclose(got.double(), xd @ wd.T + b.double(), rtol=1e-5, atol=1e-5)


def small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_quantize_model_calibrates_and_replaces() -> None:
    model = small_mlp()
    before = [p.clone() for p in model.parameters()]
    calib = [torch.randn(32, 8, generator=torch.Generator().manual_seed(2))]
    qm = quantize_model(model, calib, per_channel=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any(isinstance(m, nn.Linear) for m in qm.modules())
    first = qm[0]
    assert isinstance(first, Int8Linear) and first.w_scale.ndim == 0
    s, z = affine_qparams(calib[0].min(), calib[0].max())
    assert first.x_scale == s and first.x_zero_point == z
    x = calib[0][:4]
    assert torch.allclose(qm(x), model(x), atol=0.05)
    dyn = quantize_model(model, None)
    assert dyn[0].x_scale is None and torch.allclose(dyn(x), model(x), atol=0.05)
    wo = quantize_model(model, calib, weight_only=True)
    assert wo[0].x_scale is None and torch.allclose(wo(x), model(x), atol=0.02)


def test_int8_linear_module_validation_and_size() -> None:
    with pytest.raises(ValueError, match="int8"):
        Int8Linear(torch.zeros(2, 2), torch.tensor(1.0), None, None, None)
    with pytest.raises(ValueError, match="both"):
        Int8Linear(torch.zeros(2, 2, dtype=torch.int8), torch.tensor(1.0), torch.tensor(1.0),
                      None, None)
    model = small_mlp()
    qm = quantize_model(model, [torch.randn(4, 8)])
    # int8 weights (8*16 + 16*4) + fp32 biases, per-channel scales, x scales and int32 zps
    expected = (8 * 16 + 16 * 4) + 4 * (16 + 4) + 4 * (16 + 4) + 2 * (4 + 4)
    assert model_nbytes(qm) == expected
    assert model_nbytes(model) == 4 * (8 * 16 + 16 + 16 * 4 + 4)


def _truncating(acc, m0, shift, zp):  # type: ignore[no-untyped-def]
    return ((acc.to(torch.int64) * m0 >> (31 + shift)) + zp).clamp(-128, 127).to(torch.int8)


def _half_to_even(acc, m0, shift, zp):  # type: ignore[no-untyped-def]
    """Integer rounding, but ties to even (torch.round's rule)."""
    prod = acc.to(torch.int64) * m0
    total = 31 + shift
    low, q = prod & ((1 << total) - 1), prod >> total  # floor division
    half = 1 << (total - 1)
    up = (low > half) | ((low == half) & (q % 2 == 1))
    return (q + up.to(torch.int64) + zp).clamp(-128, 127).to(torch.int8)


def _in_float(acc, m0, shift, zp):  # type: ignore[no-untyped-def]
    real = (acc.double() * m0 * 2.0 ** -(31 + shift)).round() + zp
    return real.clamp(-128, 127).to(torch.int8)


@pytest.mark.parametrize(("fn", "why"), [
    (_truncating, "half away from zero"), (_half_to_even, "half away from zero"),
    (_in_float, "creates float64 tensors")], ids=["truncating", "half-to-even", "float"])
def test_requantize_shortcuts_fail(fn, why: str) -> None:
    with pytest.raises(CheckFailed, match=why):
        chk.requantize(fn)


def test_an_unnormalised_multiplier_fails() -> None:
    with pytest.raises(CheckFailed, match="normalise M0"):
        chk.quantize_multiplier(lambda real: (round(real * 2**31), 0))


def test_requantize_reference_is_round_half_away_of_the_exact_product() -> None:
    acc = torch.tensor([1, -1, 3, -3, 2**31 - 1, -2**31, 12345], dtype=torch.int32)
    for real, zp in ((0.5, 0), (1e-9, 3), (0.0123, -128)):
        m0, shift = quantize_multiplier(real)
        assert 2**30 <= m0 < 2**31 and abs(m0 * 2.0 ** -(31 + shift) / real - 1) < 2**-30
        exact = [int(a) * m0 / 2 ** (31 + shift) for a in acc.tolist()]
        want = [max(-128, min(127, zp + int(abs(v) + 0.5) * (1 if v >= 0 else -1)))
                for v in exact]
        assert requantize(acc, m0, shift, zp).tolist() == want
    with pytest.raises(ValueError, match="must lie in"):
        quantize_multiplier(1.0)
