"""The reference post-training int8 quantizer, written out so every step can be read.

Affine (asymmetric) quantization maps a real range ``[lo, hi]`` onto the 256 int8 codes
``[-128, 127]`` with a ``scale`` (real units per code) and an integer ``zero_point`` (the code
that stands for real 0)::

    q = clamp(round(x / scale) + zero_point, -128, 127)      x ~ (q - zero_point) * scale

Symmetric quantization fixes ``zero_point = 0`` and ``scale = max(|lo|, |hi|) / 127``.  This is
the scheme of Jacob et al. 2018 ("Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", eqs. 1-7) and of PyTorch's observers and FBGEMM.  An int8
linear layer multiplies int8 codes with int32 accumulation and rescales once per output::

    y[n, m] = x_scale * w_scale[m] * sum_k (xq[n, k] - x_zp) * wq[m, k] + bias[m]

These are the solutions the checks (``labsim.checks.quantization``) compare against;
``Int8Linear`` is the module shell that holds a quantized layer and calls a (learner's)
``linear_fn``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

QMIN, QMAX = -128, 127
EPS = float(torch.finfo(torch.float32).eps)  # smallest scale, as PyTorch's observers use


def _along(t: torch.Tensor, axis: int | None, ndim: int) -> torch.Tensor:
    """View per-channel parameters ``t`` (shape (C,)) so they broadcast along ``axis``."""
    if axis is None or t.ndim == 0:
        return t
    shape = [1] * ndim
    shape[axis] = -1
    return t.reshape(shape)


def affine_qparams(
    lo: torch.Tensor | float, hi: torch.Tensor | float, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` that map ``[lo, hi]`` onto int8, elementwise (per channel).

    The range is first widened to contain 0 (so real 0 is exactly representable: padding and
    ReLU zeros stay exact).  Symmetric: ``scale = max(|lo|, |hi|) / 127``, ``zero_point = 0``.
    Asymmetric: ``scale = (hi - lo) / 255``, ``zero_point = -128 - round(lo / scale)``.  The
    scale is at least ``EPS`` so an all-zero tensor does not divide by zero.  Returns float32
    scales and int32 zero points of the shape of ``lo``.
    """
    lo = torch.as_tensor(lo, dtype=torch.float32).clamp(max=0.0)
    hi = torch.as_tensor(hi, dtype=torch.float32).clamp(min=0.0)
    if symmetric:
        scale = (torch.maximum(-lo, hi) / QMAX).clamp(min=EPS)
        return scale, torch.zeros_like(scale, dtype=torch.int32)
    scale = ((hi - lo) / (QMAX - QMIN)).clamp(min=EPS)
    zero_point = (QMIN - torch.round(lo / scale)).clamp(QMIN, QMAX).to(torch.int32)
    return scale, zero_point


def quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None = None
) -> torch.Tensor:
    """int8 codes of ``x``: ``clamp(round(x / scale) + zero_point, -128, 127)``.

    ``scale`` and ``zero_point`` are scalars (per tensor) or vectors along ``axis`` (per
    channel).  ``round`` is round-half-to-even (``torch.round``), as in PyTorch and FBGEMM.
    """
    s = _along(torch.as_tensor(scale, dtype=torch.float32), axis, x.ndim)
    z = _along(torch.as_tensor(zero_point), axis, x.ndim)
    return (torch.round(x / s) + z).clamp(QMIN, QMAX).to(torch.int8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None = None
) -> torch.Tensor:
    """float32 values of int8 codes: ``(q - zero_point) * scale`` (broadcast along ``axis``)."""
    s = _along(torch.as_tensor(scale, dtype=torch.float32), axis, q.ndim)
    z = _along(torch.as_tensor(zero_point), axis, q.ndim)
    return (q.to(torch.float32) - z) * s


def _channel_view(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    """``x`` as (C, everything else) for per-channel statistics, or flat for per tensor."""
    x = x.detach().to(torch.float32)
    if axis is None:
        return x.reshape(1, -1)
    return x.movedim(axis, 0).reshape(x.shape[axis], -1)


class MinMaxObserver:
    """Running minimum and maximum of everything it is shown (per tensor or per channel).

    ``observe(x)`` may be called on many calibration batches; ``range()`` returns ``(lo, hi)``
    as 0-d tensors (``axis=None``) or vectors along ``axis``.
    """

    def __init__(self, axis: int | None = None) -> None:
        self.axis = axis
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        v = _channel_view(x, self.axis)
        lo, hi = v.min(dim=1).values, v.max(dim=1).values
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lo is None or self.hi is None:
            raise ValueError("the observer has seen no data: call observe(x) first")
        if self.axis is None:
            return self.lo[0], self.hi[0]
        return self.lo, self.hi


class PercentileObserver:
    """Range that ignores the rarest values: the ``100 - p`` and ``p`` percentiles (per tensor).

    It keeps every observed value (calibration sets are small) and computes the percentiles
    with linear interpolation (``torch.quantile``) over all of them when ``range()`` is called.
    Values beyond the range are clipped by quantization; in exchange the step ``scale`` is
    smaller for everything else.  NVIDIA's pytorch-quantization and TensorRT's calibrators
    offer the same choice (max, percentile, entropy).
    """

    def __init__(self, percentile: float = 99.99) -> None:
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = percentile
        self.values: list[torch.Tensor] = []

    def observe(self, x: torch.Tensor) -> None:
        self.values.append(x.detach().to(torch.float32).reshape(-1).clone())

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.values:
            raise ValueError("the observer has seen no data: call observe(x) first")
        v = torch.cat(self.values).to(torch.float64)
        p = self.percentile / 100.0
        q = torch.quantile(v, torch.tensor([1.0 - p, p], dtype=torch.float64))
        return q[0].to(torch.float32), q[1].to(torch.float32)


def int8_matmul(
    x_q: torch.Tensor, w_q: torch.Tensor, x_zero_point: torch.Tensor | int = 0
) -> torch.Tensor:
    """Exact ``(x_q - x_zero_point) @ w_q.T`` in int32: (N, K) x (M, K) -> (N, M).

    Products of two int8 codes fit in 16 bits and a sum of K of them in 16 + log2(K) bits, so
    int32 holds any K below 2**17 exactly, where a float32 accumulator is exact only below
    2**24 in magnitude.
    """
    acc = x_q.to(torch.int32) @ w_q.to(torch.int32).T
    zp = torch.as_tensor(x_zero_point, dtype=torch.int32)
    if bool(zp != 0):  # the zero-point term: zp * sum_k w_q[m, k], as FBGEMM precomputes
        acc = acc - zp * w_q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    return acc


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor,
    x_zero_point: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """An int8 linear layer: quantize ``x`` per tensor, int32 matmul, rescale, add bias.

    ``w_q`` (M, K) int8 with symmetric per-tensor (0-d) or per-output-channel (M,) ``w_scale``;
    ``x`` (N, K) float32 is quantized with ``(x_scale, x_zero_point)``.  Returns (N, M) float32
    ``acc * (x_scale * w_scale) + bias``.
    """
    x_q = quantize(x, x_scale, x_zero_point)
    acc = int8_matmul(x_q, w_q, x_zero_point)
    y = acc.to(torch.float32) * (x_scale * w_scale)
    return y if bias is None else y + bias


class Int8Linear(nn.Module):
    """A quantized ``nn.Linear``: int8 weights and the activation range it was calibrated for.

    ``x_scale``/``x_zero_point`` of ``None`` means dynamic quantization: the activation range is
    measured on each batch at run time (no calibration, one extra pass over ``x``).
    ``weight_only=True`` keeps activations in float and dequantizes the weights before a float
    matmul (what int8 weight-only decoding kernels do).  ``linear_fn`` does the int8 work and has
    the signature of ``int8_linear``.
    """

    def __init__(
        self,
        w_q: torch.Tensor,
        w_scale: torch.Tensor,
        x_scale: torch.Tensor | None,
        x_zero_point: torch.Tensor | None,
        bias: torch.Tensor | None,
        linear_fn: Callable[..., torch.Tensor] = int8_linear,
        weight_only: bool = False,
    ) -> None:
        super().__init__()
        if w_q.dtype != torch.int8 or w_q.ndim != 2:
            raise ValueError(f"w_q must be a 2-D int8 tensor, got {w_q.dtype} {tuple(w_q.shape)}")
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_scale", torch.as_tensor(w_scale, dtype=torch.float32))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        if (x_scale is None) != (x_zero_point is None):
            raise ValueError("give both x_scale and x_zero_point (static) or neither (dynamic)")
        self.register_buffer(
            "x_scale", None if x_scale is None else torch.as_tensor(x_scale, dtype=torch.float32)
        )
        self.register_buffer(
            "x_zero_point", None if x_zero_point is None else torch.as_tensor(x_zero_point)
        )
        self.linear_fn = linear_fn
        self.weight_only = weight_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.weight_only:
            w = self.w_q.to(torch.float32) * _along(self.w_scale, 0, 2)
            y = nn.functional.linear(x, w, self.bias)
        else:
            x_scale, x_zp = self.x_scale, self.x_zero_point
            if x_scale is None or x_zp is None:  # dynamic: this batch's own range
                x_scale, x_zp = affine_qparams(x.min(), x.max())
            y = self.linear_fn(x, self.w_q, self.w_scale, x_scale, x_zp, self.bias)
        return y.reshape(*shape[:-1], -1)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.w_scale.ndim else "per-tensor"
        act = "weight-only" if self.weight_only else (
            "dynamic" if self.x_scale is None else f"x_scale={float(self.x_scale):.4g}"
        )
        return f"{self.w_q.shape[1]} -> {self.w_q.shape[0]}, {kind} weights, {act}"


def quantize_weight(
    weight: torch.Tensor, per_channel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes and scales of a (M, K) weight, per output channel or per tensor."""
    obs = MinMaxObserver(axis=0 if per_channel else None)
    obs.observe(weight)
    scale, zp = affine_qparams(*obs.range(), symmetric=True)
    return quantize(weight.detach(), scale, zp, axis=0 if per_channel else None), scale


def quantize_model(
    model: nn.Module,
    calibration: Iterable[torch.Tensor] | None,
    *,
    per_channel: bool = True,
    observer: Callable[[], object] = MinMaxObserver,
    weight_only: bool = False,
    linear_fn: Callable[..., torch.Tensor] = int8_linear,
) -> nn.Module:
    """Post-training quantization: a copy of ``model`` with every ``nn.Linear`` made int8.

    Calibration runs the float model on each batch of ``calibration`` and shows the input of
    every linear layer to its own ``observer()``; each layer's activation range becomes
    asymmetric per-tensor ``(x_scale, x_zero_point)``.  Weights are symmetric, per output
    channel or per tensor.  ``calibration=None`` quantizes activations dynamically.  The
    original model is not modified.
    """
    model = copy.deepcopy(model).eval()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if calibration is not None and not weight_only:
        observers = {name: observer() for name in linears}
        hooks = [
            m.register_forward_pre_hook(lambda _m, args, n=name: observers[n].observe(args[0]))
            for name, m in linears.items()
        ]
        try:
            with torch.no_grad():
                for batch in calibration:
                    model(batch)
        finally:
            for h in hooks:
                h.remove()
        ranges = {name: obs.range() for name, obs in observers.items()}
    for name, lin in linears.items():
        w_q, w_scale = quantize_weight(lin.weight, per_channel)
        x_scale = x_zp = None
        if name in ranges:
            x_scale, x_zp = affine_qparams(*ranges[name])
        bias = None if lin.bias is None else lin.bias.detach()
        new = Int8Linear(w_q, w_scale, x_scale, x_zp, bias, linear_fn, weight_only)
        model.set_submodule(name, new)
    return model


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (what a checkpoint stores)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_multiplier(real: float) -> tuple[int, int]:
    """The real rescale ``M = x_scale * w_scale / y_scale`` of an integer-only layer as a
    fixed-point int32 multiplier and a right shift (Jacob et al. 2018, section 2.2): ``M =
    M0 * 2**-shift`` with ``M0`` in [0.5, 1) held as ``m0 = round(M0 * 2**31)`` in
    [2**30, 2**31).  ``real`` must lie in (0, 1), as it does when the output's scale is wider
    than the product of the input scales."""
    if not 0.0 < real < 1.0:
        raise ValueError(f"the real multiplier must lie in (0, 1), got {real!r}")
    mantissa, exponent = math.frexp(real)  # real = mantissa * 2**exponent, mantissa in [0.5, 1)
    m0, shift = round(mantissa * 2**31), -exponent
    if m0 == 2**31:  # the mantissa rounded up to 1.0
        m0, shift = m0 // 2, shift - 1
    return m0, shift


def requantize(acc: torch.Tensor, m0: int, shift: int, zero_point: int) -> torch.Tensor:
    """int8 output codes ``clamp(zero_point + round(acc * m0 * 2**-(31 + shift)), -128, 127)``
    from an int32 accumulator, in integers only: the product ``acc * m0`` fits in int64 (31 +
    31 bits), one rounding, half away from zero.  (gemmlowp and TFLite round twice, a rounding
    doubling high multiply then a rounding shift; the two differ by one code on rare ties.)"""
    prod = acc.to(torch.int64) * int(m0)
    total = 31 + int(shift)
    magnitude = (prod.abs() + (1 << (total - 1))) >> total
    q = torch.where(prod < 0, -magnitude, magnitude) + int(zero_point)
    return q.clamp(QMIN, QMAX).to(torch.int8)
