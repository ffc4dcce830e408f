"""Mixed precision on real tensors: number formats, gradient underflow, loss scaling, autocast.

What is measured here:

- the limits of a floating-point format (largest finite value, smallest normal and
  subnormal, machine epsilon), read from ``torch.finfo`` *and* probed by rounding real
  tensors, so the table is evidence rather than a quotation;
- how a small gradient vanishes when the backward pass runs in fp16 under ``torch.autocast``
  and how multiplying the loss by a scale keeps it (Micikevicius et al., "Mixed Precision
  Training", ICLR 2018, section 3.2);
- a small training loop (``train_amp``) that drives any loss scaler with the
  ``torch.amp.GradScaler`` interface (``scale``, ``unscale_``, ``step``, ``update``,
  ``get_scale``) on a model built so that some steps overflow, and records what happened on
  every step: loss, scale, whether the optimizer step was skipped, the unscaled gradient norm;
- what ``torch.autocast`` does to a model: the dtype each common op produces
  (``autocast_dtypes``), the bytes a ``labsim.lab.models.GPT`` forward saves for backward in
  fp32, under autocast or as a pure bf16 model (``gpt_activation_bytes``), and speed by dtype
  on this device (``matmul_flops_per_s``; ``compare_matmul_dtypes`` and
  ``compare_training_steps`` time the dtypes in interleaved rounds on one CPU thread and say
  "too noisy to tell" when the rounds disagree);
- what a 16-bit weight loses to rounding, and what keeps it: a running sum in each format
  (``accumulate``), a weight updated in plain 16 bits, through an fp32 master copy or through
  a learner's compensated 16-bit weight (``update_drift``), and SGD trained those three ways
  (``low_precision_sgd``; Zamirai et al., "Revisiting BFloat16 Training", arXiv:2010.06192).

Dtype names are the catalog's keys: ``"fp64" "fp32" "fp16" "bf16"``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from labsim.lab.device import time_fn, torch_dtype
from labsim.lab.memory import MemoryMeter
from labsim.lab.timing import Comparison, compare, one_thread, time_interleaved


@dataclass(frozen=True)
class FormatLimits:
    """The limits of one floating-point format, probed on real tensors.

    ``max`` is the largest finite value, ``smallest_normal`` the smallest value with full
    precision, ``smallest_subnormal`` the smallest value that does not round to zero
    (``smallest_normal * eps``), ``eps`` the gap between 1 and the next representable value.
    ``exponent_bits`` and ``mantissa_bits`` are the stored field widths.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float

    def __repr__(self) -> str:
        return (
            f"{self.name:>8}: {self.bits:2d} bits (e{self.exponent_bits} m{self.mantissa_bits})"
            f"  max {self.max:.4g}  normal >= {self.smallest_normal:.3g}"
            f"  subnormal >= {self.smallest_subnormal:.3g}  eps {self.eps:.3g}"
        )


def _roundtrip(value: float, dtype: torch.dtype) -> float:
    return torch.tensor(value, dtype=torch.float64).to(dtype).double().item()


def format_limits(name: str | torch.dtype) -> FormatLimits:
    """Limits of ``name`` from ``torch.finfo``, each one confirmed by rounding a tensor.

    Raises ``AssertionError`` if the hardware/library disagrees with ``finfo`` (it never
    should: this is the evidence, not a test of the learner).
    """
    dtype = torch_dtype(name)
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))
    exponent_bits = info.bits - 1 - mantissa_bits
    subnormal = info.smallest_normal * info.eps
    # Probes: the limits are exactly representable, and one step past them is not.
    assert _roundtrip(info.max, dtype) == info.max
    assert math.isinf(_roundtrip(info.max * (1 + info.eps), dtype)) or dtype in (
        torch.float8_e4m3fn,
    )
    assert _roundtrip(subnormal, dtype) == subnormal
    assert _roundtrip(subnormal / 2, dtype) == 0.0  # ties to even: half the step rounds to 0
    assert _roundtrip(1 + info.eps, dtype) == 1 + info.eps
    assert _roundtrip(1 + info.eps / 2, dtype) == 1.0
    label = name if isinstance(name, str) else str(dtype).replace("torch.", "")
    return FormatLimits(
        label, info.bits, exponent_bits, mantissa_bits, float(info.max),
        float(info.smallest_normal), float(subnormal), float(info.eps),
    )


def round_trip(values: Sequence[float] | torch.Tensor, name: str | torch.dtype) -> torch.Tensor:
    """``values`` stored in ``name`` and read back as float64 (shows rounding, flush, overflow)."""
    x = torch.as_tensor(values, dtype=torch.float64)
    return x.to(torch_dtype(name)).double()


@dataclass(frozen=True)
class LimitProbe:
    """One value at or just past a predicted limit of a format, stored in it and read back.

    ``predicted`` is what the limits say must come back (the value itself, ``inf`` or a
    rounded value); ``stored`` is what rounding a real tensor gave.
    """

    label: str
    value: float
    predicted: float
    stored: float

    @property
    def holds(self) -> bool:
        return self.stored == self.predicted

    def __repr__(self) -> str:
        mark = "as predicted" if self.holds else f"NOT the predicted {self.predicted:.6g}"
        return f"{self.label:>24}: {self.value:.6g} -> {self.stored:.6g} ({mark})"


def probe_limits(limits: Mapping[str, float], name: str | torch.dtype) -> list[LimitProbe]:
    """Test predicted ``limits`` of format ``name`` (the dict ``float_limits`` returns: "max",
    "smallest_normal", "smallest_subnormal", "eps") by rounding real tensors to it.

    Each limit must survive the round trip; one step past it must not: ``max * (1 + eps)``
    overflows to inf, half the smallest subnormal rounds to 0 (ties to even), ``1 + eps / 2``
    rounds back to 1 (IEEE 754-2019, section 4.3.1, round to nearest, ties to even)."""
    lim = {k: float(limits[k]) for k in ("max", "smallest_normal", "smallest_subnormal", "eps")}
    dtype = torch_dtype(name)
    rows = [
        ("largest finite", lim["max"], lim["max"]),
        ("largest x (1 + eps)", lim["max"] * (1 + lim["eps"]), math.inf),
        ("smallest normal", lim["smallest_normal"], lim["smallest_normal"]),
        ("smallest subnormal", lim["smallest_subnormal"], lim["smallest_subnormal"]),
        ("half of it", lim["smallest_subnormal"] / 2, 0.0),
        ("1 + eps", 1 + lim["eps"], 1 + lim["eps"]),
        ("1 + eps / 2", 1 + lim["eps"] / 2, 1.0),
    ]
    return [LimitProbe(label, value, predicted, _roundtrip(value, dtype))
            for label, value, predicted in rows]


@dataclass(frozen=True)
class UnderflowResult:
    """Gradients of one layer's weight in fp16 autocast against a float64 reference.

    ``zero_fraction`` is the fraction of weight-gradient elements that came back exactly 0
    although the exact gradient is not; ``rel_error`` the relative L2 error of the gradient;
    ``output_grad_abs_median`` the median |dL/d(output)| before scaling.
    """

    loss_scale: float
    zero_fraction: float
    rel_error: float
    output_grad_abs_median: float

    def __repr__(self) -> str:
        return (
            f"UnderflowResult(loss_scale={self.loss_scale:g}: "
            f"{self.zero_fraction:.1%} of gradients flushed to 0, "
            f"rel. error {self.rel_error:.2e})"
        )


def fp16_gradient_underflow(
    loss_scale: float = 1.0, *, residual: float = 1e-4, seed: int = 0
) -> UnderflowResult:
    """The weight gradient of one ``Linear(64, 32)`` under ``torch.autocast(float16)``.

    The targets sit ``residual`` away from the layer's own fp16 output (late in training the
    errors are small), so the gradient of the MSE loss with respect to the output is about
    ``2 * residual / 4096`` per element: below fp16's smallest subnormal 2**-24 (5.96e-8)
    for ``residual=1e-4``.  The loss is multiplied by ``loss_scale`` before backward and the
    gradient divided by it afterwards in fp32, as ``GradScaler.unscale_`` does.  The
    reference is the same gradient computed in float64 from the same forward pass, so the
    only errors measured are those of the fp16 backward.
    """
    if not loss_scale > 0:
        raise ValueError("loss_scale must be > 0")
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(64, 32)
    x = torch.randn(128, 64, generator=gen)
    noise = torch.randn(128, 32, generator=gen)
    with torch.autocast("cpu", dtype=torch.float16):
        out = layer(x)  # fp16
    y = out.detach().float() + residual * noise
    loss = nn.functional.mse_loss(out.float(), y)
    (g,) = torch.autograd.grad(loss * loss_scale, [layer.weight])
    g = g.double() / loss_scale
    g_out = 2.0 * (out.detach().double() - y.double()) / out.numel()  # dL/d(out), float64
    g_ref = g_out.T @ x.to(torch.float16).double()  # (32, 64), the exact weight gradient
    nonzero = g_ref != 0
    zero_fraction = ((g == 0) & nonzero).sum().item() / max(1, nonzero.sum().item())
    rel = ((g - g_ref).norm() / g_ref.norm()).item()
    return UnderflowResult(loss_scale, zero_fraction, rel, g_out.abs().median().item())


class LossScaler(Protocol):
    """The part of ``torch.amp.GradScaler``'s interface that ``train_amp`` uses."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...
    def update(self) -> None: ...
    def get_scale(self) -> float: ...


@dataclass(frozen=True)
class AmpRun:
    """What happened on every step of ``train_amp``.

    ``scales[i]`` is the scale used on step i (before ``update``), ``skipped[i]`` whether the
    optimizer left the weights untouched, ``grad_norms[i]`` the L2 norm of the unscaled
    gradient (inf or nan on an overflowing step), ``final_scale`` the scale after the last
    update and ``weights`` the final parameters (fp32) in ``named_parameters`` order.
    """

    losses: tuple[float, ...]
    scales: tuple[float, ...]
    skipped: tuple[bool, ...]
    grad_norms: tuple[float, ...]
    final_scale: float
    weights: tuple[torch.Tensor, ...]

    @property
    def skipped_steps(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.skipped) if s)

    def __repr__(self) -> str:
        return (
            f"AmpRun({len(self.losses)} steps, skipped {list(self.skipped_steps)}, "
            f"loss {self.losses[0]:.4g} -> {self.losses[-1]:.4g}, "
            f"final scale {self.final_scale:g})"
        )


def amp_model(seed: int = 0, width: int = 64) -> nn.Module:
    """The model ``train_amp`` trains: Linear-GELU-Linear-GELU-Linear, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
        nn.Linear(width, 8),
    )


def train_amp(
    make_scaler: Callable[[], LossScaler],
    *,
    steps: int = 30,
    seed: int = 0,
    lr: float = 0.03,
    target_scale: float = 30.0,
    dtype: str = "fp16",
) -> AmpRun:
    """Train ``amp_model(seed)`` for ``steps`` steps with autocast and the scaler it makes.

    The model learns a random linear map whose outputs are large (standard deviation
    ``target_scale``), so the gradient of the loss is large too: with a scale of about 2**14
    or more, ``scale * dL/dy`` exceeds fp16's 65504 and the backward pass produces inf.  A
    dynamic scaler therefore skips a step, backs off, grows again after its growth interval
    and overflows again: the run shows every branch of the algorithm while the loss falls.
    Adam updates the weights.  The same inputs with ``GradScaler`` are the oracle.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    model = amp_model(seed)
    width = model[0].in_features
    gen = torch.Generator().manual_seed(seed + 1)
    w_true = torch.randn(width, 8, generator=gen) / math.sqrt(width)
    x = torch.randn(steps, 32, width, generator=gen)
    y = target_scale * x @ w_true  # a learnable map whose outputs have std ~ target_scale
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = make_scaler()
    params = list(model.parameters())
    losses, scales, skipped, norms = [], [], [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch_dtype(dtype)):
            out = model(x[i])
        loss = nn.functional.mse_loss(out.float(), y[i])
        scales.append(float(scaler.get_scale()))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = [p.grad for p in params if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.double()) for g in grads])).item())
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, params)))
        losses.append(loss.item())
    weights = tuple(p.detach().clone() for p in params)
    return AmpRun(
        tuple(losses), tuple(scales), tuple(skipped), tuple(norms),
        float(scaler.get_scale()), weights,
    )


def grad_scaler(**kwargs: Any) -> Callable[[], torch.amp.GradScaler]:
    """A factory of ``torch.amp.GradScaler("cpu", **kwargs)`` for ``train_amp``."""
    return lambda: torch.amp.GradScaler("cpu", **kwargs)


# --------------------------------------------------------------------------------------
# What autocast does


def autocast_dtypes(dtype: str = "bf16", device: str = "cpu") -> dict[str, str]:
    """The output dtype of common ops inside ``torch.autocast(dtype)``, the matmul-like ones
    on fp32 inputs and the rest on the output of a matmul (as in a model).

    Which list an op is on (cast to the low dtype, cast to fp32, or neither) differs by
    device: ``autocast_lists`` tells them apart.
    """
    low = torch_dtype(dtype)
    x = torch.randn(8, 16, device=device)
    w = torch.randn(16, 16, device=device)
    target = torch.randint(0, 16, (8,), device=device)
    ops: dict[str, Callable[[], torch.Tensor]] = {
        "linear": lambda: nn.functional.linear(x, w),
        "matmul": lambda: x @ w,
        "relu": lambda: torch.relu(x),
        "gelu": lambda: nn.functional.gelu(x),
        "softmax": lambda: torch.softmax(x @ w, dim=-1),
        "layer_norm": lambda: nn.functional.layer_norm(x @ w, (16,)),
        "mse_loss": lambda: nn.functional.mse_loss(x @ w, x),
        "cross_entropy": lambda: nn.functional.cross_entropy(x @ w, target),
        "sum": lambda: (x @ w).sum(),
    }
    out = {}
    with torch.autocast(torch.device(device).type, dtype=low):
        for name, op in ops.items():
            out[name] = str(op().dtype).replace("torch.", "")
    return out


def accumulate(value: float, times: int, dtype: str | torch.dtype) -> float:
    """Add ``value`` ``times`` times into an accumulator of ``dtype``, rounding after every
    addition as a 16-bit running sum does; the exact answer is ``value * times``.  Once half
    the accumulator's spacing exceeds ``value``, every addition rounds away (bf16 stops at 4
    for 0.01)."""
    step = torch.tensor(value, dtype=torch_dtype(dtype))
    total = torch.zeros((), dtype=step.dtype)
    for _ in range(times):
        total = total + step
    return float(total)


class UpdatableWeight(Protocol):
    """A weight that takes updates: ``add_(update)`` and the tensor the model uses,
    ``weight``."""

    weight: torch.Tensor

    def add_(self, update: torch.Tensor) -> None: ...


class PlainWeight:
    """A weight kept in its 16-bit dtype and updated with a plain ``+``: every addition is
    rounded to the format, so an update below half the spacing of the weight is lost."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.weight = self.weight + update


class MasterWeight:
    """Mixed precision's answer (Micikevicius et al. 2018, section 3.1): an fp32 master copy
    takes the updates, and the model uses its 16-bit copy, refreshed after every update --
    4 + 2 bytes per parameter."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.master = weight.float()
        self.weight = weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.master += update.float()
        self.weight = self.master.to(self.weight.dtype)


WeightFactory = Callable[[torch.Tensor], UpdatableWeight]


def state_bytes(weight: object) -> int:
    """Bytes of every tensor ``weight`` holds in its attributes (and one level down in lists,
    tuples and dicts), each storage once."""
    seen: dict[int, int] = {}

    def note(value: object) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for value in vars(weight).values():
        note(value)
        if isinstance(value, (list, tuple)):
            for item in value:
                note(item)
        elif isinstance(value, dict):
            for item in value.values():
                note(item)
    return sum(seen.values())


@dataclass(frozen=True)
class DriftRow:
    """One run of updates applied three ways: the exact result (float64) and what a plain
    16-bit weight, an fp32 master copy (read as its 16-bit copy) and ``yours`` end at."""

    label: str
    exact: float
    plain: float
    master: float
    yours: float

    def __repr__(self) -> str:
        return (f"{self.label:<34} exact {self.exact:<9.6g} plain {self.plain:<9.6g} "
                f"fp32 master {self.master:<9.6g} yours {self.yours:.6g}")


def _apply(make: WeightFactory, start: torch.Tensor, update: torch.Tensor, times: int
           ) -> float:
    weight = make(start.clone())
    for _ in range(times):
        weight.add_(update.clone())
    return float(weight.weight.double().reshape(-1)[0])


def update_drift(make_weight: WeightFactory, dtype: str = "bf16") -> list[DriftRow]:
    """The two runs of the lab's section 5 through ``make_weight`` (a class such as
    ``PlainWeight``): 1000 updates of 0.01 from 0, and 100 updates of -0.001 from 1."""
    dt = torch_dtype(dtype)
    rows = []
    for label, start, step, times in (("0 + 1000 updates of 0.01", 0.0, 0.01, 1000),
                                      ("1 + 100 updates of -0.001", 1.0, -1e-3, 100)):
        w0 = torch.tensor([start], dtype=dt)
        u = torch.tensor([step], dtype=dt)
        exact = start + float(u.double()) * times
        rows.append(DriftRow(f"{label} ({dtype})", exact,
                             *(_apply(m, w0, u, times)
                               for m in (PlainWeight, MasterWeight, make_weight))))
    return rows


@dataclass(frozen=True)
class SgdRun:
    """A linear model trained by SGD with its weight kept one way: the bytes per parameter
    that way holds (``state_bytes``) and the test error after training."""

    label: str
    bytes_per_param: float
    test_mse: float

    def __repr__(self) -> str:
        return (f"{self.label:<34} {self.bytes_per_param:3.0f} B/param, "
                f"test error {self.test_mse:.3g}")


def low_precision_sgd(
    make_weight: WeightFactory, *, steps: int = 400, lr: float = 0.05, seed: int = 0,
    dtype: str = "bf16", width: int = 64, outputs: int = 8, batch: int = 32,
) -> list[SgdRun]:
    """Train a ``width -> outputs`` linear map by SGD on a noiseless teacher, with the weight
    kept in ``dtype`` three ways: ``PlainWeight``, ``MasterWeight`` and ``make_weight``.

    Every step reads the model's 16-bit ``weight``, computes the gradient of the mean squared
    error from it (in fp32, as a 16-bit matmul with fp32 accumulation would) and hands
    ``-lr * grad`` rounded to ``dtype`` to ``add_``: only the update's addition differs.  As
    the error falls the updates shrink below half the weights' spacing, and a plain 16-bit
    weight stops learning ("nearest rounding for model weight updates often cancels small
    updates": Zamirai et al., "Revisiting BFloat16 Training", arXiv:2010.06192).  The test
    error is the mean squared error on 256 fresh inputs.  Runs on one CPU thread."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(width, outputs, generator=gen) / math.sqrt(width)
    x = torch.randn(steps, batch, width, generator=gen)
    x_test = torch.randn(256, width, generator=gen)
    y, y_test = x @ teacher, x_test @ teacher
    runs = []
    with one_thread():
        for label, make in (("plain 16-bit weight", PlainWeight),
                            ("fp32 master + 16-bit copy", MasterWeight),
                            ("16-bit weight, yours", make_weight)):
            weight = make(torch.zeros(width, outputs, dtype=torch_dtype(dtype)))
            for i in range(steps):
                residual = x[i] @ weight.weight.float() - y[i]
                grad = 2 * x[i].T @ residual / residual.numel()
                weight.add_((-lr * grad).to(torch_dtype(dtype)))
            test = (x_test @ weight.weight.float() - y_test).square().mean().item()
            runs.append(SgdRun(label, state_bytes(weight) / (width * outputs), test))
    return runs


AUTOCAST_LISTS = ("low precision", "fp32", "neither: runs in the dtype it receives")


def autocast_lists(dtype: str = "bf16", device: str = "cpu") -> dict[str, str]:
    """Which of PyTorch's autocast lists ("Autocast Op Reference" in the AMP docs) each common
    op is on, for ``device``, found by running it inside ``torch.autocast(dtype)`` on an fp32
    and on a low-precision input: an op that turns fp32 into the low dtype is on the
    low-precision list, one that turns the low dtype into fp32 on the fp32 list, and one whose
    output keeps its input's dtype on neither (e.g. ``softmax`` and ``layer_norm`` on a CPU,
    which are on the fp32 list on CUDA).  Values are ``AUTOCAST_LISTS`` entries."""
    low = torch_dtype(dtype)
    w = torch.randn(16, 16, device=device)
    target = torch.randint(0, 16, (8,), device=device)
    ops: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "linear": lambda a: nn.functional.linear(a, w.to(a.dtype)),
        "matmul": lambda a: a @ w.to(a.dtype),
        "relu": torch.relu,
        "gelu": nn.functional.gelu,
        "softmax": lambda a: torch.softmax(a, dim=-1),
        "layer_norm": lambda a: nn.functional.layer_norm(a, (16,)),
        "mse_loss": lambda a: nn.functional.mse_loss(a, a.detach() * 0.5),
        "cross_entropy": lambda a: nn.functional.cross_entropy(a, target),
        "sum": lambda a: a.sum(),
    }
    x = torch.randn(8, 16, device=device)
    out = {}
    with torch.autocast(torch.device(device).type, dtype=low):
        for name, op in ops.items():
            if op(x).dtype == low:
                out[name] = AUTOCAST_LISTS[0]
            elif op(x.to(low)).dtype == torch.float32:
                out[name] = AUTOCAST_LISTS[1]
            else:
                out[name] = AUTOCAST_LISTS[2]
    return out


def matmul_flops_per_s(
    n: int, dtype: str, device: torch.device | str = "cpu", max_seconds: float = 2.0
) -> float:
    """Achieved FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (2 n^3 FLOP per call)."""
    dt = torch_dtype(dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    timing = time_fn(lambda: a @ b, device=device, warmup=1, repeat=5, max_seconds=max_seconds)
    return 2 * n**3 / timing.min_s


PRECISION_MODES = ("fp32", "autocast-bf16", "autocast-fp16", "pure-bf16")


def gpt_saved_bytes(model: nn.Module, idx: torch.Tensor, mode: str = "fp32"
                    ) -> tuple[int, int]:
    """(all bytes autograd saves for backward in one forward of ``model(idx)``, the part of
    them that is low-precision copies of the weights): under ``torch.autocast`` every linear
    layer casts its fp32 weight to the low dtype and keeps that copy for the backward pass
    (``MemoryMeter.weight_copies``).  ``mode`` as for ``gpt_activation_bytes``."""
    if mode not in PRECISION_MODES:
        raise ValueError(f"mode={mode!r}; use one of {PRECISION_MODES}")
    if mode == "pure-bf16":
        model = copy.deepcopy(model).to(torch.bfloat16)
    low = torch.float16 if mode == "autocast-fp16" else torch.bfloat16
    with MemoryMeter(model) as meter:
        with torch.autocast(idx.device.type, dtype=low, enabled=mode.startswith("autocast")):
            out = model(idx)
    del out
    return meter.saved_bytes, meter.weight_copies()[1]


def gpt_activation_bytes(model: nn.Module, idx: torch.Tensor, mode: str = "fp32") -> int:
    """Bytes autograd saves for backward in one forward of ``model(idx)`` (a ``labsim.lab.GPT``).

    ``mode``: ``"fp32"``; ``"autocast-bf16"`` / ``"autocast-fp16"`` (fp32 weights, the
    forward under ``torch.autocast``); ``"pure-bf16"`` (a bf16 copy of the whole model, as
    when the optimizer keeps no fp32 master weights).
    """
    return gpt_saved_bytes(model, idx, mode)[0]


def training_step_time(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, dtype: str | None,
    *, repeat: int = 5, max_seconds: float = 10.0,
) -> float:
    """Median seconds of forward + backward + AdamW step of a ``labsim.lab.GPT``, in fp32
    (``dtype=None``) or with autocast(``dtype``) (bf16 needs no loss scaler)."""
    device_type = idx.device.type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch_dtype(dtype or "bf16"),
                            enabled=dtype is not None):
            _, loss = model(idx, targets)
        loss.backward()
        opt.step()

    timing = time_fn(step, device=idx.device, warmup=2, repeat=repeat, max_seconds=max_seconds)
    return timing.median_s


@dataclass(frozen=True)
class DtypeComparison:
    """Two dtypes timed in interleaved rounds: achieved FLOP/s of each (median round) and the
    verdict of ``labsim.lab.timing.compare``."""

    label: str
    flops_per_s: dict[str, float]
    comparison: Comparison

    def __repr__(self) -> str:
        from labsim.units import fmt_flops

        rates = ", ".join(f"{d} {fmt_flops(r)}" for d, r in self.flops_per_s.items())
        return f"{self.label}: {rates} -> {self.comparison.verdict}"


def _threads(device: torch.device | str) -> Any:
    return one_thread() if torch.device(device).type == "cpu" else nullcontext()


def compare_matmul_dtypes(
    n: int, dtypes: tuple[str, str] = ("fp32", "bf16"), device: torch.device | str = "cpu",
    *, rounds: int = 5, max_seconds: float = 3.0,
) -> DtypeComparison:
    """An ``n x n @ n x n`` matmul in each of ``dtypes`` (2 n^3 FLOP a call), timed in
    ``rounds`` interleaved rounds (on one thread on a CPU), compared round by round."""
    mats = {}
    for d in dtypes:
        dt = torch_dtype(d)
        mats[d] = (torch.randn(n, n, device=device).to(dt), torch.randn(n, n, device=device).to(dt))
    fns = {d: (lambda a=a, b=b: a @ b) for d, (a, b) in mats.items()}
    with _threads(device):
        timings = time_interleaved(fns, device=device, rounds=rounds, max_seconds=max_seconds)
    return DtypeComparison(f"{n}x{n} matmul", {d: 2 * n**3 / t.median_s
                                                for d, t in timings.items()},
                           compare(timings, *dtypes))


def compare_training_steps(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, dtype: str = "bf16",
    *, rounds: int = 5, max_seconds: float = 20.0,
) -> Comparison:
    """Forward + backward + AdamW step of a ``labsim.lab.GPT`` in fp32 and under
    ``torch.autocast(dtype)``, timed in interleaved rounds and compared round by round
    (``Comparison.verdict``; names "fp32" and "<dtype> autocast")."""
    device_type = idx.device.type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(low: bool) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch_dtype(dtype), enabled=low):
            _, loss = model(idx, targets)
        loss.backward()
        opt.step()

    fns = {"fp32": lambda: step(False), f"{dtype} autocast": lambda: step(True)}
    with _threads(idx.device):
        timings = time_interleaved(fns, device=idx.device, warmup=2, rounds=rounds,
                                   max_seconds=max_seconds)
    return compare(timings, "fp32", f"{dtype} autocast")
