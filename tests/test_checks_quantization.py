"""The int8 checks pass the reference, fail a stub, and catch the typical bugs."""

from __future__ import annotations

import pytest
import torch

from labsim.checks import CheckFailed
from labsim.checks import quantization as chk
from labsim.lab import quantization as q8


def stub(*args: object, **kwargs: object) -> None:
    raise NotImplementedError


class StubObserver:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def observe(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def range(self) -> None:
        raise NotImplementedError


def test_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    chk.affine_qparams(q8.affine_qparams)
    chk.quantize_dequantize(q8.quantize, q8.dequantize)
    chk.minmax_observer(q8.MinMaxObserver)
    chk.percentile_observer(q8.PercentileObserver)
    chk.int8_matmul(q8.int8_matmul)
    chk.int8_linear(q8.int8_linear)
    chk.quantize_model(q8.quantize_model)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and all(line.startswith("PASS ") for line in lines)


@pytest.mark.parametrize("run", [
    lambda: chk.affine_qparams(stub),
    lambda: chk.quantize_dequantize(stub, stub),
    lambda: chk.minmax_observer(StubObserver),
    lambda: chk.percentile_observer(StubObserver),
    lambda: chk.int8_matmul(stub),
    lambda: chk.int8_linear(stub),
    lambda: chk.quantize_model(stub),
])
def test_stubs_fail(run) -> None:
    with pytest.raises(CheckFailed, match=r"FAIL \w+: 0/\d+ cases passed"):
        run()


def test_catches_a_zero_point_not_widened_to_include_zero() -> None:
    def no_widening(lo, hi, symmetric=False):
        if symmetric:
            return q8.affine_qparams(lo, hi, symmetric)
        lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
        scale = (hi - lo) / 255
        return scale, (-128 - torch.round(lo / scale)).to(torch.int32)

    with pytest.raises(CheckFailed, match="positive-only"):
        chk.affine_qparams(no_widening)


def test_catches_truncation_instead_of_rounding() -> None:
    def truncating(x, scale, zero_point, axis=None):
        return (x / scale + zero_point).clamp(-128, 127).to(torch.int8)

    with pytest.raises(CheckFailed, match="tiny tensor"):
        chk.quantize_dequantize(truncating, q8.dequantize)


def test_catches_an_int8_or_float_accumulator() -> None:
    def float32_acc(x_q, w_q, zp):
        return ((x_q.float() - float(zp)) @ w_q.float().T).to(torch.int32)

    with pytest.raises(CheckFailed, match="2\\*\\*24"):
        chk.int8_matmul(float32_acc)

    def int64_acc(x_q, w_q, zp):
        return (x_q.long() - int(zp)) @ w_q.long().T

    with pytest.raises(CheckFailed, match="int32"):
        chk.int8_matmul(int64_acc)


def test_catches_a_missing_zero_point_in_the_linear_layer() -> None:
    def no_zp(x, w_q, w_scale, x_scale, x_zero_point, bias=None):
        acc = q8.int8_matmul(q8.quantize(x, x_scale, x_zero_point), w_q, 0)
        y = acc.float() * (x_scale * w_scale)
        return y if bias is None else y + bias

    with pytest.raises(CheckFailed):
        chk.int8_linear(no_zp)


def test_catches_a_model_quantized_in_place_or_ignoring_per_channel() -> None:
    def in_place(model, calibration, *, per_channel=True, observer=q8.MinMaxObserver):
        quantized = q8.quantize_model(model, calibration, per_channel=per_channel,
                                      observer=observer)
        for name, module in quantized.named_children():
            model.add_module(name, module)  # the caller's model is changed
        return quantized

    with pytest.raises(CheckFailed, match="unchanged"):
        chk.quantize_model(in_place)

    def always_per_channel(model, calibration, *, per_channel=True, observer=q8.MinMaxObserver):
        return q8.quantize_model(model, calibration, per_channel=True, observer=observer)

    with pytest.raises(CheckFailed, match="per-tensor"):
        chk.quantize_model(always_per_channel)


def test_catches_a_percentile_that_is_a_min_max() -> None:
    class MinMaxPretendingPercentile(q8.MinMaxObserver):
        def __init__(self, percentile: float = 99.99) -> None:
            super().__init__()

    with pytest.raises(CheckFailed, match="percentile 99.0"):
        chk.percentile_observer(MinMaxPretendingPercentile)
