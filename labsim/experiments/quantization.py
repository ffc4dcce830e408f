"""Measuring a quantized model: size, accuracy and speed, and PyTorch's own int8 paths.

``Table`` is a small result object (rows of named columns) with a text and an HTML face, so a
notebook cell shows a readable table without printing from library code.
"""

from __future__ import annotations

import contextlib
import copy
import html
import importlib.util
import io
import logging
import statistics
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labsim.lab.device import Timing, time_fn
from labsim.lab.timing import compare, spread, time_interleaved


@dataclass(frozen=True)
class Table:
    """Rows of values under ``columns``; floats are shown with ``digits`` significant digits."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    title: str = ""
    digits: int = 4

    def _cell(self, v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.{self.digits}g}"
        return "" if v is None else str(v)

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def __repr__(self) -> str:
        cells = [list(self.columns)] + [[self._cell(v) for v in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(([self.title] if self.title else []) + lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(self._cell(v))}</td>" for v in r) + "</tr>"
            for r in self.rows
        )
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def with_outlier_channel(
    model: nn.Sequential, layer: int = 0, unit: int = 0, factor: float = 100.0
) -> nn.Sequential:
    """The same function with one outlier channel: a copy of ``model`` where output ``unit``
    of linear ``model[layer]`` (weight row and bias) is multiplied by ``factor`` and the
    matching input column of the next linear layer divided by it.

    ReLU is positively homogeneous (relu(a x) = a relu(x) for a > 0), so in exact arithmetic
    the outputs do not change; only the ranges that quantization must cover do: one weight row
    and one activation channel are ``factor`` times larger than the rest, the pattern Dettmers
    et al. 2022 (LLM.int8()) found in large transformers.
    """
    if factor <= 0:
        raise ValueError("factor must be > 0 (a negative factor would flip a ReLU)")
    m = copy.deepcopy(model)
    linears = [i for i, mod in enumerate(m) if isinstance(mod, nn.Linear)]
    if layer not in linears or linears.index(layer) + 1 >= len(linears):
        raise ValueError(f"model[{layer}] must be a Linear followed by another Linear")
    nxt = linears[linears.index(layer) + 1]
    between = m[layer + 1 : nxt]
    if not all(isinstance(mod, nn.ReLU) for mod in between):
        raise ValueError("only ReLUs may sit between the two linear layers")
    with torch.no_grad():
        m[layer].weight[unit] *= factor
        if m[layer].bias is not None:
            m[layer].bias[unit] *= factor
        m[nxt].weight[:, unit] /= factor
    return m


def pytorch_dynamic_int8(model: nn.Module) -> tuple[nn.Module, str]:
    """``torch.ao.quantization.quantize_dynamic`` on every Linear (FBGEMM/oneDNN int8 kernels).

    Returns the quantized copy and the deprecation warning PyTorch gives (empty if none): the
    ``torch.ao.quantization`` eager API is deprecated in favour of torchao.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8
        )
    notes = sorted({str(w.message).split("\n")[0] for w in caught})
    return qmodel, " | ".join(notes)


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Raise logger ``name``'s level to ERROR for the duration (import-time chatter)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class _TorchaoEnumConstant(logging.Filter):
    """Drops torch's notice that an Enum of torchao's is registered as a pytree constant.

    torchao (0.18) decorates its Enum ``KernelPreference`` with
    ``torchao.utils.register_as_pytree_constant``, which calls
    ``torch.utils._pytree.register_constant``; torch 2.13 treats Enums natively and logs, on
    logger ``torch.utils._pytree``, that registering one "is deprecated and will be an error
    in a future release".  The notice is for torchao's authors (their next release drops the
    call or breaks); only that record, for a class of torchao's, is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (isinstance(cls, type) and cls.__module__.startswith("torchao.")
                    and "is an Enum subclass" in str(record.msg))


@contextlib.contextmanager
def _without_enum_notice() -> Iterator[None]:
    """``_TorchaoEnumConstant`` on torch's pytree logger for the duration (torchao's import)."""
    logger = logging.getLogger("torch.utils._pytree")
    notice = _TorchaoEnumConstant()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def torchao_int8(model: nn.Module, weight_only: bool = False) -> tuple[nn.Module | None, str]:
    """torchao's int8 (dynamic activations + int8 weights, or weight-only) if installed.

    Returns ``(None, reason)`` when torchao is missing or does not work with this torch.
    """
    if importlib.util.find_spec("torchao") is None:
        return None, "torchao is not installed (pip install torchao; it does not pull a torch)"
    try:
        with warnings.catch_warnings(), _quiet_logger("torchao"), _without_enum_notice():
            # torchao warns at import when its C++ kernels do not match this torch build; the
            # Python paths used here work without them, so the learner cannot act on it
            warnings.simplefilter("ignore")
            import torchao
            from torchao.quantization import (
                Int8DynamicActivationInt8WeightConfig,
                Int8WeightOnlyConfig,
                quantize_,
            )

        qmodel = copy.deepcopy(model)
        config = Int8WeightOnlyConfig() if weight_only else Int8DynamicActivationInt8WeightConfig()
        quantize_(qmodel, config)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        return None, f"torchao failed here: {type(exc).__name__}: {exc}"
    return qmodel, f"torchao {torchao.__version__}"


@dataclass(frozen=True, repr=False)  # shown as the table it is
class SpeedTable(Table):
    """``time_models``' result: a ``Table`` (median milliseconds per call, their quartiles, and
    the speed-up over the first model: the median of the rounds' ratios and its quartiles),
    with each batch size's ``Timing`` per model, round by round, for verdicts."""

    timings: Mapping[int, Mapping[str, Timing]] = field(default_factory=dict, repr=False)

    @property
    def base(self) -> str:
        """The model the others are compared with (the first one timed)."""
        return self.rows[0][0]

    def speedup(self, name: str, batch: int) -> tuple[float, float, float]:
        """Median, lower and upper quartile over the rounds of (time of the base) / (time of
        ``name``) at ``batch``: above 1, ``name`` is faster."""
        return _ratios(self.timings[batch][self.base], self.timings[batch][name])

    def verdict(self, name: str, batch: int) -> str:
        """``labsim.lab.timing.compare``'s verdict on the base and ``name`` at ``batch``."""
        return compare(self.timings[batch], self.base, name).verdict

    def reading(self, name: str, batch: int) -> str:
        """The speed-up in a few words: "2.19x (2.05-2.30x)", "the same within 10 % (...)",
        or "too noisy to tell (...)" when the rounds disagree."""
        med, low, high = self.speedup(name, batch)
        comparison = compare(self.timings[batch], self.base, name)
        band = f"{low:.2f}-{high:.2f}x over {comparison.rounds} rounds"
        if not comparison.settled:
            return f"too noisy to tell ({band})"
        if comparison.same_speed:
            return f"the same within {(comparison.threshold - 1) * 100:.0f} % ({band})"
        return f"{med:.3g}x ({band})"


def _ratios(base: Timing, other: Timing) -> tuple[float, float, float]:
    ratios = [b / o for b, o in zip(base.times_s, other.times_s)]
    low, high = spread(ratios)
    return statistics.median(ratios), low, high


def time_models(
    models: Mapping[str, Callable[[torch.Tensor], Any] | None],
    batches: Sequence[int],
    features: int,
    *,
    repeat: int = 5,
    max_seconds: float | None = None,
    seed: int = 0,
    threads: int | None = None,
    progress: str | None = None,
) -> SpeedTable:
    """Time each model on (batch, features) inputs, every batch size in ``repeat`` interleaved
    rounds (``labsim.lab.timing.time_interleaved``: one call of each model per round, the
    order rotating, so that a load that comes and goes slows all of them alike), after one
    untimed call of each.  ``None`` entries are skipped; ``max_seconds`` stops a batch size
    after the round that passes it; ``progress`` labels a bar of the batch sizes timed.

    ``threads`` sets PyTorch's intra-op threads while timing (restored afterwards); one thread
    gives figures that compare across machines and survive a busy CPU, where threads that
    wait for each other can make a 1 ms call take 30 ms.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _time_models(models, batches, features, repeat, max_seconds, seed, progress)
    finally:
        torch.set_num_threads(previous)


def _time_models(
    models: Mapping[str, Callable[[torch.Tensor], Any] | None],
    batches: Sequence[int],
    features: int,
    repeat: int,
    max_seconds: float | None,
    seed: int,
    progress: str | None,
) -> SpeedTable:
    gen = torch.Generator().manual_seed(seed)
    inputs = {b: torch.randn(b, features, generator=gen) for b in batches}
    live = {name: fn for name, fn in models.items() if fn is not None}
    timings: dict[int, dict[str, Timing]] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches), unit="batch size", desc=progress, leave=False)
    try:
        with torch.no_grad():
            for b in batches:
                timings[b] = time_interleaved(
                    {name: (lambda f=fn, x=inputs[b]: f(x)) for name, fn in live.items()},
                    rounds=repeat, max_seconds=max_seconds)
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    base = next(iter(live))
    rows = []
    for name in live:
        for b in batches:
            t = timings[b][name]
            q1, q3 = spread(t.times_s)
            med, low, high = _ratios(timings[b][base], t)
            rows.append((name, b, t.median_s * 1e3, f"{q1 * 1e3:.3g}-{q3 * 1e3:.3g}", med,
                         f"{low:.3g}-{high:.3g}"))
    return SpeedTable(("layer", "batch", "ms per call", "ms, quartiles", "speed-up vs first",
                       "speed-up, quartiles"), tuple(rows), timings=timings)


def linear_nbytes(model: nn.Module) -> int:
    """Bytes of the weights of the linear layers (float or int8), scales and biases excluded."""
    total = 0
    for m in model.modules():
        w = getattr(m, "w_q", None)
        if w is None and isinstance(m, nn.Linear):
            w = m.weight
        if w is not None:
            total += w.numel() * w.element_size()
    return total


def checkpoint_nbytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: what the model really costs on disk,
    packed int8 weights, scales, zero points, biases and format overhead included."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def int_mm_table(
    device: torch.device | str,
    shapes: Sequence[tuple[int, int, int]] = ((32, 8192, 8192), (4096, 8192, 8192)),
    repeat: int = 10,
) -> Table:
    """Time int8 x int8 -> int32 ``torch._int_mm`` against an fp16 matmul on a CUDA GPU.

    Shapes are (m, k, n); ``_int_mm`` needs m > 16 and k, n multiples of 8 on CUDA.  Returns
    milliseconds and achieved TOP/s (int8) and TFLOP/s (fp16).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("int_mm_table times GPU tensor cores: pass a CUDA device")
    rows = []
    for m, k, n in shapes:
        a8 = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
        b8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device).t()
        a16, b16 = a8.half(), b8.half()
        t8 = time_fn(lambda a=a8, b=b8: torch._int_mm(a, b), device=device, repeat=repeat)
        t16 = time_fn(lambda a=a16, b=b16: a @ b, device=device, repeat=repeat)
        ops = 2.0 * m * k * n
        rows.append((f"{m}x{k}x{n}", t16.median_s * 1e3, t8.median_s * 1e3,
                     ops / t16.median_s / 1e12, ops / t8.median_s / 1e12,
                     t16.median_s / t8.median_s))
    cols = ("m x k x n", "fp16 ms", "int8 ms", "fp16 TFLOP/s", "int8 TOP/s", "int8 speed-up")
    return Table(cols, tuple(rows), title=torch.cuda.get_device_name(device))


def layer_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input of every ``nn.Linear`` of ``model`` when it runs on ``x``, by module name."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, args, n=name: seen.__setitem__(n, args[0].detach().clone())
        )
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def range_table(
    calibration: torch.Tensor,
    test: torch.Tensor,
    observers: Mapping[str, Callable[[], Any]],
    qparams: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    quantize: Callable[..., torch.Tensor],
    dequantize: Callable[..., torch.Tensor],
) -> Table:
    """For each observer fed ``calibration``: its range, the step (scale), the fraction of
    ``test`` values it clips and the root-mean-square quantization error on ``test``."""
    rows = []
    for name, make in observers.items():
        obs = make()
        obs.observe(calibration)
        lo, hi = obs.range()
        scale, zp = qparams(lo, hi)
        back = dequantize(quantize(test, scale, zp), scale, zp)
        err = back - test
        clipped = float((err.abs() > scale / 2 * (1 + 1e-4)).float().mean())
        rms = float(err.pow(2).mean().sqrt())
        rows.append((name, float(lo), float(hi), float(scale), clipped, rms))
    cols = ("observer", "lo", "hi", "scale (step)", "test values clipped", "RMS error")
    return Table(cols, tuple(rows))


def accuracy_table(
    baseline: nn.Module, variants: Mapping[str, nn.Module | None], data: Any
) -> Table:
    """Test accuracy of each variant, its change from ``baseline`` in percentage points and
    the fraction of test inputs whose predicted class differs from the baseline's."""
    with torch.no_grad():
        base_pred = baseline(data.x).argmax(dim=1)
        base_acc = float((base_pred == data.y).float().mean())
        rows = [("fp32 (baseline)", base_acc * 100, 0.0, 0.0)]
        for name, model in variants.items():
            if model is None:
                continue
            pred = model(data.x).argmax(dim=1)
            acc = float((pred == data.y).float().mean())
            flips = float((pred != base_pred).float().mean())
            rows.append((name, acc * 100, (acc - base_acc) * 100, flips * 100))
    cols = ("model", "accuracy %", "change (points)", "predictions changed %")
    return Table(cols, tuple(rows))
