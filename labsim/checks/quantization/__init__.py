"""Checks for the int8 quantization lab: quantization parameters, quantize/dequantize,
observers, the int32-accumulating matmul, the int8 linear layer and post-training quantization.

Every check compares the learner's function with the reference (``reference``, beside this
file) on small, seeded cases, exact integers where the answer is an integer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labsim.checks._core import Case, close, raises, run_check
from labsim.checks.quantization import reference as ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _exact(dtype: torch.dtype) -> Callable[[Any, Any], str | None]:
    """Tensors of ``dtype`` equal element for element."""

    def compare(got: Any, expected: torch.Tensor) -> str | None:
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.dtype != dtype:
            return f"dtype {got.dtype} instead of {dtype}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
        if not torch.equal(got, expected):
            at = tuple((got != expected).nonzero()[0].tolist())
            return f"at index {list(at)}: {got[at].item()} instead of {expected[at].item()}"
        return None

    return compare


def affine_qparams(fn: Callable[..., Any]) -> None:
    """``fn(lo, hi, symmetric) -> (scale, zero_point)``, per tensor and per channel."""
    t = torch.tensor
    inputs = [
        ("asymmetric range around 0", t(-1.0), t(3.0), False),
        ("symmetric: the larger magnitude sets the scale", t(-1.0), t(2.0), True),
        ("positive-only range is widened to include 0", t(2.0), t(5.0), False),
        ("negative-only range is widened to include 0", t(-4.0), t(-1.0), False),
        ("all zeros: scale floored at eps, no division by zero", t(0.0), t(0.0), False),
        ("per channel (vectors), asymmetric", t([-1.0, -0.5, 0.0]), t([1.0, 2.0, 0.25]), False),
        ("per channel (vectors), symmetric", t([-3.0, -0.5]), t([1.0, 2.0]), True),
    ]
    cases = []
    for name, lo, hi, sym in inputs:
        scale, zp = ref.affine_qparams(lo, hi, sym)
        cases.append(Case(name, (lo, hi, sym), expected=(scale, zp.to(torch.float32))))

    def wrapped(lo: torch.Tensor, hi: torch.Tensor, sym: bool) -> Any:
        scale, zp = fn(lo, hi, sym)
        return torch.as_tensor(scale), torch.as_tensor(zp).to(torch.float32)

    run_check("affine_qparams", wrapped, cases, compare=close(rtol=1e-6, atol=0.0))


def quantize_dequantize(quantize: Callable[..., Any], dequantize: Callable[..., Any]) -> None:
    """Exact codes on tiny tensors, round-trip error bounds, per-channel axes, an outlier row."""
    t = torch.tensor
    cases = [
        Case(
            "tiny tensor, scale 0.5, zero point 3 (round half to even, clamp at both ends)",
            ("codes", t([0.0, 0.25, 0.75, -1.0, 100.0, -100.0]), t(0.5), t(3), None),
            expected=t([3, 3, 5, 1, 127, -128], dtype=torch.int8),
            compare=_exact(torch.int8),
        ),
        Case(
            "per channel along axis 0",
            ("codes", t([[1.0, -1.0], [1.0, -1.0]]), t([0.1, 1.0]), t([0, 10]), 0),
            expected=t([[10, -10], [11, 9]], dtype=torch.int8),
            compare=_exact(torch.int8),
        ),
        Case(
            "per channel along axis 1",
            ("codes", t([[1.0, 1.0], [-1.0, -1.0]]), t([0.1, 1.0]), t([0, -5]), 1),
            expected=t([[10, -4], [-10, -6]], dtype=torch.int8),
            compare=_exact(torch.int8),
        ),
        Case(
            "dequantize: (q - zero_point) * scale as float32",
            ("values", t([-128, 0, 3, 127], dtype=torch.int8), t(0.5), t(3), None),
            expected=t([-65.5, -1.5, 0.0, 62.0]),
            compare=close(rtol=0, atol=0),
        ),
    ]
    x = torch.randn(1000, generator=_gen(1)) * 3
    scale, zp = ref.affine_qparams(x.min(), x.max())
    cases.append(
        Case(
            "round trip inside the range: error <= scale / 2",
            ("max_error_over_half_step", x, scale, zp, None),
            expected=True,
        )
    )
    w = torch.randn(8, 64, generator=_gen(2)) * 0.05
    w[3] *= 100.0  # one outlier output channel
    cases.append(
        Case(
            "weight with one outlier channel: per-channel error < per-tensor error",
            ("per_channel_wins", w, None, None, None),
            expected=True,
        )
    )

    def run(kind: str, x: torch.Tensor, scale: Any, zp: Any, axis: int | None) -> Any:
        if kind == "codes":
            return quantize(x, scale, zp, axis)
        if kind == "values":
            return dequantize(x, scale, zp, axis)
        if kind == "max_error_over_half_step":
            err = (dequantize(quantize(x, scale, zp, None), scale, zp, None) - x).abs().max()
            return bool(err <= scale / 2 * (1 + 1e-5))
        errors = []
        for axis_ in (None, 0):
            obs = ref.MinMaxObserver(axis=axis_)
            obs.observe(x)
            s, z = ref.affine_qparams(*obs.range(), symmetric=True)
            back = dequantize(quantize(x, s, z, axis_), s, z, axis_)
            expect = ref.dequantize(ref.quantize(x, s, z, axis_), s, z, axis_)
            if not torch.allclose(back, expect, rtol=1e-6, atol=1e-7):
                return f"axis={axis_}: values differ from the reference"
            errors.append(float(((back - x) ** 2).mean()))
        return errors[1] < errors[0]

    run_check("quantize_dequantize", run, cases)


def _observe(cls: Callable[..., Any], kwargs: dict, batches: list[torch.Tensor]) -> Any:
    obs = cls(**kwargs)
    for b in batches:
        obs.observe(b)
    lo, hi = obs.range()
    return torch.as_tensor(lo, dtype=torch.float32), torch.as_tensor(hi, dtype=torch.float32)


def minmax_observer(cls: Callable[..., Any]) -> None:
    """``cls(axis=None)`` with ``observe(x)`` and ``range() -> (lo, hi)``."""
    g = _gen(3)
    batches = [torch.randn(16, 4, generator=g) * (i + 1) for i in range(3)]
    inputs = [
        ("one batch, per tensor", {}, batches[:1]),
        ("running min/max over three batches", {}, batches),
        ("per channel along axis 0", {"axis": 0}, [b.T for b in batches]),
        ("per channel along axis 1", {"axis": 1}, batches),
        ("negative-only data", {}, [-batches[0].abs() - 1]),
        ("a 3-D activation, per channel on the last axis", {"axis": -1},
         [torch.randn(2, 5, 3, generator=g)]),
    ]
    cases = [
        Case(name, (kw, bs), expected=_observe(ref.MinMaxObserver, kw, bs))
        for name, kw, bs in inputs
    ]
    cases.append(
        Case("range() before any observe() raises ValueError", ({}, []), compare=raises(ValueError))
    )
    run_check("minmax_observer", lambda kw, bs: _observe(cls, kw, bs), cases, compare=close(0, 0))


def percentile_observer(cls: Callable[..., Any]) -> None:
    """``cls(percentile)``: the (100 - p)th and pth percentiles of everything observed."""
    g = _gen(4)
    normal = torch.randn(20_000, generator=g)
    spiky = normal.clone()
    spiky[::2000] = 50.0  # ten rare spikes, like an activation outlier
    batches = list(spiky.reshape(4, 50, 100))
    cases = [
        Case(
            f"percentile {p} of four batches",
            ("range", {"percentile": p}, batches),
            expected=_observe(ref.PercentileObserver, {"percentile": p}, batches),
        )
        for p in (99.0, 99.99)
    ]
    cases.append(
        Case(
            "percentile 100 is the min/max range",
            ("range", {"percentile": 100.0}, batches),
            expected=(spiky.min(), spiky.max()),
        )
    )
    def clipped_fraction(lo: torch.Tensor, hi: torch.Tensor) -> float:
        # a value is clipped when its reconstruction is more than half a step away
        scale, zp = ref.affine_qparams(lo, hi)
        back = ref.dequantize(ref.quantize(spiky, scale, zp), scale, zp)
        return float(((back - spiky).abs() > scale / 2 * (1 + 1e-4)).float().mean())

    for p in (99.9, 100.0):
        clipped = clipped_fraction(*_observe(ref.PercentileObserver, {"percentile": p}, batches))
        cases.append(
            Case(
                f"calibrated at {p}: the fraction of calibration values quantization clips",
                ("clipped", {"percentile": p}, batches),
                expected=clipped,
            )
        )
    cases.append(
        Case(
            "range() before any observe() raises ValueError",
            ("range", {"percentile": 99.0}, []),
            compare=raises(ValueError),
        )
    )

    def run(kind: str, kw: dict, bs: list[torch.Tensor]) -> Any:
        lo, hi = _observe(cls, kw, bs)
        return (lo, hi) if kind == "range" else clipped_fraction(lo, hi)

    run_check("percentile_observer", run, cases, compare=close(rtol=1e-5, atol=1e-6))


def int8_matmul(fn: Callable[..., Any]) -> None:
    """``fn(x_q, w_q, x_zero_point) -> int32``: exact, also past float32's 2**24."""
    g = _gen(5)

    def ri(*shape: int) -> torch.Tensor:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)

    big_x = torch.full((2, 2048), 127, dtype=torch.int8)
    big_x[1, 0] = -128
    big_w = torch.full((3, 2048), 127, dtype=torch.int8)
    big_w[0, 5] = 126
    inputs = [
        ("2x3 by 2x3, zero point 0", ri(2, 3), ri(2, 3), 0),
        ("zero point 5 subtracted from every x code", ri(3, 4), ri(5, 4), 5),
        ("negative zero point", ri(1, 7), ri(2, 7), -128),
        ("K = 1", ri(4, 1), ri(3, 1), 0),
        ("sums beyond 2**24 (float32 would round): int32 is exact", big_x, big_w, 0),
        ("all -128 with zero point 127", torch.full((2, 64), -128, dtype=torch.int8),
         torch.full((2, 64), -128, dtype=torch.int8), 127),
    ]
    cases = []
    for name, xq, wq, zp in inputs:
        expected = ((xq.long() - zp) @ wq.long().T).to(torch.int32)
        cases.append(Case(name, (xq, wq, torch.tensor(zp)), expected=expected))
    run_check("int8_matmul", fn, cases, compare=_exact(torch.int32))


def int8_linear(fn: Callable[..., Any]) -> None:
    """``fn(x, w_q, w_scale, x_scale, x_zero_point, bias) -> float32`` against the reference."""
    g = _gen(6)
    cases = []
    for name, n, k, m, per_channel, with_bias, stretch in [
        ("per-tensor weights, with bias", 4, 16, 8, False, True, 1.0),
        ("per-channel weights, with bias", 4, 16, 8, True, True, 1.0),
        ("no bias", 3, 8, 5, True, False, 1.0),
        ("one row (batch 1)", 1, 32, 4, True, True, 1.0),
        ("inputs beyond the calibrated range are clipped", 6, 16, 8, True, True, 3.0),
    ]:
        w = torch.randn(m, k, generator=g) * 0.2
        w_q, w_scale = ref.quantize_weight(w, per_channel)
        calib = torch.randn(64, k, generator=g).relu()
        x_scale, x_zp = ref.affine_qparams(calib.min(), calib.max())
        x = torch.randn(n, k, generator=g).relu() * stretch
        bias = torch.randn(m, generator=g) if with_bias else None
        args = (x, w_q, w_scale, x_scale, x_zp, bias)
        cases.append(Case(name, args, expected=ref.int8_linear(*args)))
    run_check("int8_linear", fn, cases, compare=close(rtol=1e-5, atol=1e-5))


class _Nested(nn.Module):
    """A model whose linear layers sit at different depths (names like ``block.0``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.block = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def quantize_model(fn: Callable[..., Any]) -> None:
    """``fn(model, calibration, per_channel=, observer=)``: every Linear int8, outputs right."""
    g = _gen(8)
    calibration = [torch.randn(16, 6, generator=g) for _ in range(3)]
    x = torch.randn(32, 6, generator=g)
    minmax = ref.MinMaxObserver

    def percentile() -> ref.PercentileObserver:
        return ref.PercentileObserver(90.0)

    cases = []
    for name, calib, per_channel, observer in [
        ("per-channel weights, min/max calibration over 3 batches", calibration, True, minmax),
        ("per-tensor weights, min/max calibration", calibration, False, minmax),
        ("calibration on a single batch", calibration[:1], True, minmax),
        ("the observer given is used (percentile 90)", calibration, True, percentile),
        ("no calibration (None): dynamic activation ranges", None, True, minmax),
    ]:
        got = _summarise(ref.quantize_model, _Nested(), calib, per_channel, observer, x)
        cases.append(Case(name, (calib, per_channel, observer), expected=got))
    run_check(
        "quantize_model",
        lambda calib, pc, obs: _summarise(fn, _Nested(), calib, pc, obs, x),
        cases,
        compare=close(rtol=1e-4, atol=1e-4),
    )


def _summarise(
    fn: Callable[..., Any],
    model: nn.Module,
    calib: Any,
    per_channel: bool,
    observer: Callable[[], Any],
    x: torch.Tensor,
) -> dict[str, Any]:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = fn(model, calib, per_channel=per_channel, observer=observer)
    after = model.state_dict()
    unchanged = set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in after)
    int8 = [m for m in qmodel.modules() if isinstance(m, ref.Int8Linear)]
    with torch.no_grad():
        out = qmodel(x)
    return {
        "original model left unchanged": unchanged,
        "nn.Linear layers left": sum(isinstance(m, nn.Linear) for m in qmodel.modules()),
        "Int8Linear layers": len(int8),
        "per-channel weight scales": [m.w_scale.ndim == 1 for m in int8],
        "outputs": out,
    }
