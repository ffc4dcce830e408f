"""Checks for the int8 quantization lab: quantization parameters, quantize/dequantize,
observers, the int32-accumulating matmul, the int8 linear layer and post-training quantization.

Every check compares the learner's function with the reference (``reference``, beside this
file) on small, seeded cases, exact integers where the answer is an integer.  The learner's
code must not call the reference (only the module shell ``Int8Linear`` is given), nor
PyTorch's own quantization kernels; the integer exercises must do integer arithmetic: the
recorder sees every matmul's operand dtypes and every floating-point tensor created.

The recorder sees torch's operators only, so the integer exercises must keep the work in
torch: handing a tensor to numpy breaks their rules however numpy reads it -- ``.numpy()``,
``.tolist()``, and ``np.asarray(t)``, ``np.array(t)``, a numpy function or ``np.from_dlpack``
applied to a tensor, which reach the tensor through ``Tensor.__array__`` or
``Tensor.__dlpack__`` called from numpy's C code (``DataExits``, run by these checks'
driver) -- and the products must be computed by torch's operators on integer tensors (an
integer matmul, ``torch._int_mm``, or integer products summed), not in Python numbers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from labsim.checks._core import Case, Outcome, Spec, call_each, close, raises
from labsim.checks._observe import LEAVES_TORCH, _prefixes, passed_references, trusted
from labsim.checks.quantization import reference as ref
from labsim.checks.quantization.requantize import quantize_multiplier, requantize

_R = "labsim.checks.quantization.reference"
_SHELLS = ("Int8Linear",)
_GIVEN_OBSERVERS = ("MinMaxObserver", "PercentileObserver")
REFERENCES = tuple(f"{_R}:{n}" for n in (
    "affine_qparams", "quantize", "dequantize", "MinMaxObserver", "PercentileObserver",
    "int8_matmul", "int8_linear", "quantize_weight", "quantize_model", "model_nbytes",
    "quantize_multiplier", "requantize"))
_TORCH_OBS = "torch.ao.quantization.observer"
FORBID = (*REFERENCES, *(f"{_TORCH_OBS}:{n}" for n in (
    "MinMaxObserver", "PerChannelMinMaxObserver", "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver", "HistogramObserver",
    "UniformQuantizationObserverBase")), "torch.ao.quantization.quantize:quantize_dynamic")
FORBID_MODEL = tuple(t for t in FORBID if t.rsplit(":", 1)[-1] not in _GIVEN_OBSERVERS)
TORCH_QUANT_OPS = ("quantize_per", "dequantize", "fake_quantize", "_make_per",
                   "quantized::", "choose_qparams", "int_repr")
FLOATS = {"float16", "bfloat16", "float32", "float64"}
INTEGERS = {"int8", "uint8", "int16", "int32", "int64"}
PRODUCT_OPS = ("aten::mul", "aten::mul_", "aten::addcmul", "aten::addcmul_")
# what numpy calls on a tensor it is handed, to read its data (from C: no frame of numpy's own
# between the call and the code that handed it the tensor)
NUMPY_READS = frozenset({"__array__", "__dlpack__"})
_LIBRARIES = tuple(os.path.join(os.path.dirname(os.path.realpath(m.__file__)), "")
                   for m in (torch, numpy))


class DataExits(TorchFunctionMode):
    """Notes each call that hands a tensor's data out of torch (``LEAVES_TORCH``) made by code
    that is not library code.  ``.numpy()``, ``.tolist()`` and the like count when the code
    calling them is untrusted (a notebook cell; a tensor printed by torch's own formatting
    does not count); ``Tensor.__array__`` and ``__dlpack__`` (``NUMPY_READS``), which numpy
    calls from its C code when it is handed a tensor, count when the first frame above them
    that is neither torch's nor numpy's is untrusted.

    Run innermost (closest to the learner's function), it also sees what ``watch``'s own
    log of function names would attribute to it, so it takes over that part of the
    ``torch_only`` rule for the checks that run it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.prefixes = _prefixes()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if name in LEAVES_TORCH:
            frame = sys._getframe(1)
            while name in NUMPY_READS and frame is not None and os.path.realpath(
                    frame.f_code.co_filename).startswith(_LIBRARIES):
                frame = frame.f_back
            if frame is not None and not trusted(frame.f_code.co_filename, self.prefixes):
                self.names.add(name)
        return func(*args, **(kwargs or {}))


def _drive_in_torch(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                    ) -> list[Outcome]:
    """``call_each``, with ``DataExits`` watching each case: the ways the tensors' data left
    torch are added to the case's observations as ``left_torch``."""
    outcomes = []
    for case in cases:
        exits = DataExits()
        out = call_each([_under(exits, fns[0])], [case], spec)[0]
        outcomes.append(replace(out, observed={**out.observed,
                                               "left_torch": sorted(exits.names)}))
    return outcomes


def _under(mode: TorchFunctionMode, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with ``mode`` on."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return fn(*args, **kwargs)

    return run


def _stays_in_torch(case: Case, out: Outcome) -> str | None:
    """No tensor data handed out of torch: not to numpy (``.numpy()``, ``np.asarray``,
    ``np.array``, a numpy function given a tensor), Python lists or raw pointers."""
    left = out.observed.get("left_torch") or []
    if left:
        how = (", which numpy calls to read a tensor it is handed" if left[0] in NUMPY_READS
               else "")
        return (f"it moved tensor data out of torch (`Tensor.{left[0]}`{how}); this "
                "exercise's rules are checked on torch's operators, so do the integer "
                "arithmetic on torch tensors")
    return None


def _integer_products(case: Case, out: Outcome) -> str | None:
    """The products are computed by torch's operators: an integer matmul (``aten::mm``,
    ``bmm``, ``_int_mm``...) or elementwise products (``aten::mul``, on integers where the
    check also holds ``_integer_only``), not in Python numbers."""
    ops = out.observed.get("ops") or {}
    int_mm = set(out.observed.get("matmul_dtypes") or ()) & INTEGERS
    if int_mm or any(op in ops for op in PRODUCT_OPS):
        return None
    return ("torch computed no integer products (no integer matmul, no products summed): "
            "multiply the int8 codes as integer tensors, e.g. an int32 matmul or "
            "torch._int_mm, so that the recorder sees integer arithmetic")


def _no_torch_quantization(case: Case, out: Outcome) -> str | None:
    used = sorted(n for n in out.observed.get("ops", {}) if any(q in n for q in TORCH_QUANT_OPS))
    if used:
        return f"it uses PyTorch's quantization kernels ({', '.join(used)[:120]})"
    return None


def _integer_only(case: Case, out: Outcome) -> str | None:
    """No floating point anywhere: no matmul on floats, no float tensor created, no tensor
    value turned into a Python float."""
    mm = sorted(set(out.observed.get("matmul_dtypes", [])) & FLOATS)
    made = sorted(set(out.observed.get("float_dtypes", [])))
    python = ["Python float"] if "__float__" in (out.observed.get("functions") or ()) else []
    if mm or made or python:
        return (f"it computes in floating point ({', '.join(mm + made + python)}); an int8 "
                "matmul multiplies integer codes with int32 accumulation")
    return None


def _integer_matmul(case: Case, out: Outcome) -> str | None:
    """The matmul of the int8 layer multiplies integer codes (rescaling in float is fine)."""
    mm = sorted(set(out.observed.get("matmul_dtypes", [])) & FLOATS)
    if mm:
        return (f"its matmul multiplies {', '.join(mm)} values; quantize x and multiply the "
                "int8 codes with int32 accumulation (your int8_matmul)")
    return None


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


def _affine_qparams_cases() -> list[Case]:
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
    return cases


def _as_qparams(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(lo: torch.Tensor, hi: torch.Tensor, sym: bool) -> Any:
        scale, zp = fn(lo, hi, sym)
        return torch.as_tensor(scale), torch.as_tensor(zp).to(torch.float32)

    return wrapped


affine_qparams = Spec("affine_qparams", _affine_qparams_cases,
                      drive=lambda fns, cases, spec: call_each([_as_qparams(fns[0])], cases,
                                                               spec),
                      compare=close(rtol=1e-6, atol=0.0), rules=(_no_torch_quantization,),
                      forbid=FORBID)
"""``fn(lo, hi, symmetric) -> (scale, zero_point)``, per tensor and per channel."""


def _half_step(x: torch.Tensor, scale: torch.Tensor) -> Callable[[Any, Any], str | None]:
    def compare(got: Any, expected: Any) -> str | None:
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return "expected the reconstructed tensor, shaped like x"
        err = float((got.double() - x.double()).abs().max())
        bound = float(scale) / 2 * (1 + 1e-5)
        return None if err <= bound else f"round-trip error {err:.4g} > scale / 2 = {bound:.4g}"

    return compare


def _roundtrip_case(name: str, w: torch.Tensor, axis: int | None) -> Case:
    obs = ref.MinMaxObserver(axis=axis)
    obs.observe(w)
    s, z = ref.affine_qparams(*obs.range(), symmetric=True)
    expected = ref.dequantize(ref.quantize(w, s, z, axis), s, z, axis)
    return Case(name, ("roundtrip", w, s, z, axis), expected=expected,
                compare=close(rtol=1e-6, atol=1e-7))


def _quantize_dequantize_cases() -> list[Case]:
    t = torch.tensor
    cases = [
        Case("tiny tensor, scale 0.5, zero point 3 (round half to even, clamp at both ends)",
             ("codes", t([0.0, 0.25, 0.75, -1.0, 100.0, -100.0]), t(0.5), t(3), None),
             expected=t([3, 3, 5, 1, 127, -128], dtype=torch.int8), compare=_exact(torch.int8)),
        Case("per channel along axis 0",
             ("codes", t([[1.0, -1.0], [1.0, -1.0]]), t([0.1, 1.0]), t([0, 10]), 0),
             expected=t([[10, -10], [11, 9]], dtype=torch.int8), compare=_exact(torch.int8)),
        Case("per channel along axis 1",
             ("codes", t([[1.0, 1.0], [-1.0, -1.0]]), t([0.1, 1.0]), t([0, -5]), 1),
             expected=t([[10, -4], [-10, -6]], dtype=torch.int8), compare=_exact(torch.int8)),
        Case("dequantize: (q - zero_point) * scale as float32",
             ("values", t([-128, 0, 3, 127], dtype=torch.int8), t(0.5), t(3), None),
             expected=t([-65.5, -1.5, 0.0, 62.0]), compare=close(rtol=0, atol=0)),
    ]
    x = torch.randn(1000, generator=_gen(1)) * 3
    scale, zp = ref.affine_qparams(x.min(), x.max())
    cases.append(Case("round trip inside the range: error <= scale / 2",
                      ("roundtrip", x, scale, zp, None), expected=x,
                      compare=_half_step(x, scale)))
    w = torch.randn(8, 64, generator=_gen(2)) * 0.05
    w[3] *= 100.0  # one outlier output channel: per tensor, every other row loses precision
    cases.append(_roundtrip_case("weight with one outlier channel, per tensor", w, None))
    cases.append(_roundtrip_case("the same weight per channel (axis 0)", w, 0))
    return cases


def _drive_qdq(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
               ) -> list[Outcome]:
    quantize, dequantize = fns

    def run(kind: str, x: torch.Tensor, scale: Any, zp: Any, axis: int | None) -> Any:
        if kind == "codes":
            return quantize(x, scale, zp, axis)
        if kind == "values":
            return dequantize(x, scale, zp, axis)
        return dequantize(quantize(x, scale, zp, axis), scale, zp, axis)

    return call_each([run], cases, spec)


quantize_dequantize = Spec("quantize_dequantize", _quantize_dequantize_cases, drive=_drive_qdq,
                           rules=(_no_torch_quantization,), forbid=FORBID, functions=2)
"""Exact codes on tiny tensors, round-trip error bounds, per-channel axes, an outlier row."""


def _observe(cls: Callable[..., Any], kwargs: dict, batches: list[torch.Tensor]) -> Any:
    obs = cls(**kwargs)
    for b in batches:
        obs.observe(b)
    lo, hi = obs.range()
    return torch.as_tensor(lo, dtype=torch.float32), torch.as_tensor(hi, dtype=torch.float32)


def _drive_observer(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                    ) -> list[Outcome]:
    cls = fns[0]
    return call_each([lambda *a: _observe(cls, *a[-2:])], cases, spec)


def _minmax_observer_cases() -> list[Case]:
    g = _gen(3)
    batches = [torch.randn(16, 4, generator=g) * (i + 1) for i in range(3)]
    inputs = [
        ("one batch, per tensor", {}, batches[:1]),
        ("running min/max over three batches", {}, batches),
        ("per channel along axis 0", {"axis": 0}, [b.T.contiguous() for b in batches]),
        ("per channel along axis 1", {"axis": 1}, batches),
        ("negative-only data", {}, [-batches[0].abs() - 1]),
        ("a 3-D activation, per channel on the last axis", {"axis": -1},
         [torch.randn(2, 5, 3, generator=g)]),
    ]
    cases = [Case(name, (kw, bs), expected=_observe(ref.MinMaxObserver, kw, bs))
             for name, kw, bs in inputs]
    cases.append(Case("range() before any observe() raises ValueError", ({}, []),
                      compare=raises(ValueError)))
    return cases


minmax_observer = Spec("minmax_observer", _minmax_observer_cases, drive=_drive_observer,
                       compare=close(0, 0), rules=(_no_torch_quantization,), forbid=FORBID)
"""``cls(axis=None)`` with ``observe(x)`` and ``range() -> (lo, hi)``."""


def _spiky() -> torch.Tensor:
    spiky = torch.randn(20_000, generator=_gen(4))
    spiky[::2000] = 50.0  # ten rare spikes, like an activation outlier
    return spiky


def clipped_fraction(lo: torch.Tensor, hi: torch.Tensor) -> float:
    """The fraction of the calibration values that quantization with range (lo, hi) clips
    (reconstructed more than half a step away)."""
    spiky = _spiky()
    scale, zp = ref.affine_qparams(lo, hi)
    back = ref.dequantize(ref.quantize(spiky, scale, zp), scale, zp)
    return float(((back - spiky).abs() > scale / 2 * (1 + 1e-4)).float().mean())


def _clipped_compare(got: Any, expected: Any) -> str | None:
    if not isinstance(got, tuple) or len(got) != 2:
        return "range() must return (lo, hi)"
    return close(rtol=1e-5, atol=1e-6)(clipped_fraction(*got), expected)


def _percentile_observer_cases() -> list[Case]:
    spiky = _spiky()
    batches = list(spiky.reshape(4, 50, 100))
    cases = [Case(f"percentile {p} of four batches", ("range", {"percentile": p}, batches),
                  expected=_observe(ref.PercentileObserver, {"percentile": p}, batches))
             for p in (99.0, 99.99)]
    cases.append(Case("percentile 100 is the min/max range",
                      ("range", {"percentile": 100.0}, batches),
                      expected=(spiky.min(), spiky.max())))
    for p in (99.9, 100.0):
        rng = _observe(ref.PercentileObserver, {"percentile": p}, batches)
        cases.append(Case(f"calibrated at {p}: the fraction of calibration values "
                          "quantization clips", ("clipped", {"percentile": p}, batches),
                          expected=clipped_fraction(*rng), compare=_clipped_compare))
    cases.append(Case("range() before any observe() raises ValueError",
                      ("range", {"percentile": 99.0}, []), compare=raises(ValueError)))
    return cases


percentile_observer = Spec("percentile_observer", _percentile_observer_cases,
                           drive=_drive_observer, compare=close(rtol=1e-5, atol=1e-6),
                           rules=(_no_torch_quantization,), forbid=FORBID)
"""``cls(percentile)``: the (100 - p)th and pth percentiles of everything observed."""


def _int8_matmul_cases() -> list[Case]:
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
        # K = 2, not 1: torch._int_mm on a CPU (oneDNN's s8 x s8 -> s32 path, torch 2.13 on an
        # AVX-512 VNNI CPU) returns uninitialised values when K = 1, and an honest call to it
        # must pass (pytorch/pytorch#195066 reports a size-1 dimension failing silently too)
        ("K = 2, a short inner dimension", ri(4, 2), ri(3, 2), 0),
        ("sums beyond 2**24 (float32 would round): int32 is exact", big_x, big_w, 0),
        ("all -128 with zero point 127", torch.full((2, 64), -128, dtype=torch.int8),
         torch.full((2, 64), -128, dtype=torch.int8), 127),
    ]
    return [Case(name, (xq, wq, torch.tensor(zp)),
                 expected=((xq.long() - zp) @ wq.long().T).to(torch.int32))
            for name, xq, wq, zp in inputs]


int8_matmul = Spec("int8_matmul", _int8_matmul_cases, drive=_drive_in_torch,
                   compare=_exact(torch.int32),
                   rules=(_stays_in_torch, _integer_only, _integer_products), forbid=FORBID,
                   torch_only=True)
"""``fn(x_q, w_q, x_zero_point) -> int32``: exact, also past float32's 2**24, and computed
in integers by torch (no floating-point tensor anywhere, nothing handed to numpy)."""


def _int8_linear_cases() -> list[Case]:
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
    return cases


int8_linear = Spec("int8_linear", _int8_linear_cases, drive=_drive_in_torch,
                   compare=close(rtol=1e-5, atol=1e-5),
                   rules=(_stays_in_torch, _integer_matmul, _integer_products,
                          _no_torch_quantization), forbid=FORBID, torch_only=True)
"""``fn(x, w_q, w_scale, x_scale, x_zero_point, bias) -> float32`` against the reference,
with the matmul done by torch on integer codes (nothing handed to numpy)."""


class _Nested(nn.Module):
    """A model whose linear layers sit at different depths (names like ``block.0``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.block = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


OBSERVERS: dict[str, Callable[[], Any]] = {
    "min/max": ref.MinMaxObserver,
    "percentile 90": lambda: ref.PercentileObserver(90.0),
}


def _model_inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = _gen(8)
    calibration = [torch.randn(16, 6, generator=g) for _ in range(3)]
    return calibration, torch.randn(32, 6, generator=g)


def _quantize_model_cases() -> list[Case]:
    calibration, x = _model_inputs()
    cases = []
    for name, calib, per_channel, observer in [
        ("per-channel weights, min/max calibration over 3 batches", calibration, True,
         "min/max"),
        ("per-tensor weights, min/max calibration", calibration, False, "min/max"),
        ("calibration on a single batch", calibration[:1], True, "min/max"),
        ("the observer given is used (percentile 90)", calibration, True, "percentile 90"),
        ("no calibration (None): dynamic activation ranges", None, True, "min/max"),
    ]:
        got = _summarise(ref.quantize_model, calib, per_channel, observer, x)
        cases.append(Case(name, (calib, per_channel, observer, x), expected=got))
    return cases


def _drive_model(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                 ) -> list[Outcome]:
    """Like ``call_each``, and the ``linear_fn`` each ``Int8Linear`` was given must not be
    the reference (the shell's default)."""
    fn = fns[0]
    shells: list[Any] = []

    def run(calib: Any, pc: bool, obs: str, x: torch.Tensor) -> dict[str, Any]:
        return _summarise(fn, calib, pc, obs, x, shells)

    outcomes = call_each([run], cases, spec)
    given = passed_references([m.linear_fn for m in shells], spec.forbid)
    if given:
        outcomes = [replace(o, observed={**o.observed, "references": [
            *o.observed.get("references", []), *given]}) for o in outcomes]
    return outcomes


quantize_model = Spec("quantize_model", _quantize_model_cases, drive=_drive_model,
                      compare=close(rtol=1e-4, atol=1e-4), rules=(_no_torch_quantization,),
                      forbid=FORBID_MODEL,
                      gives=tuple(f"{_R}:{n}" for n in (*_GIVEN_OBSERVERS, "Int8Linear",
                                                          "affine_qparams")))
"""``fn(model, calibration, per_channel=, observer=)``: every Linear int8, outputs right."""


def _summarise(fn: Callable[..., Any], calib: Any, per_channel: bool, observer: str,
               x: torch.Tensor, shells: list[Any] | None = None) -> dict[str, Any]:
    model = _Nested()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = fn(model, calib, per_channel=per_channel, observer=OBSERVERS[observer])
    after = model.state_dict()
    unchanged = set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in after)
    int8 = [m for m in qmodel.modules() if isinstance(m, ref.Int8Linear)]
    if shells is not None:
        shells.extend(int8)
    with torch.no_grad():
        out = qmodel(x)
    return {
        "original model left unchanged": unchanged,
        "nn.Linear layers left": sum(isinstance(m, nn.Linear) for m in qmodel.modules()),
        "Int8Linear layers": len(int8),
        "per-channel weight scales": [m.w_scale.ndim == 1 for m in int8],
        "outputs": out,
    }
