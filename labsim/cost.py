"""What a training run costs: wall time, GPU-hours, energy and dollars for a token budget.

A dense transformer of N parameters trained on D tokens takes about ``6 N D`` FLOPs (forward
2 N D, backward 4 N D; Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section
2.1; attention's extra FLOPs are ignored, a few per cent at these sizes).  At a model FLOPs
utilisation ``mfu`` (Chowdhery et al. 2022, PaLM, appendix B) on ``gpus`` GPUs of dense peak
``P``, the run takes ``6 N D / (gpus P mfu)`` seconds.  The MFU comes from wherever the user
trusts: a measurement, a published run, or ``labsim.estimate_step`` / ``plan_search`` (the
simulated MFU of the plan that will run).

Energy counts the GPUs only, each at its board power (``GPU.tdp_W``, from the datasheets) or
a given average draw, times the facility's power usage effectiveness ``pue`` (1.0: the GPUs'
own draw; CPUs, memory, NICs, switches and cooling are outside it unless ``pue`` says so).
Prices are inputs, never built in: ``PRICES`` lists a few with their sources and dates, and
``owned_usd_per_gpu_hour`` turns a purchase price, a service life and electricity into an
hourly rate comparable with a cloud's.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from labsim.hardware import GPU
from labsim.hardware import gpu as gpu_named

HOUR_S = 3600.0
DAY_S = 86400.0
J_PER_KWH = 3.6e6


def _positive(name: str, value: object, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r}: must be a finite number "
                         f"{'>= 0' if allow_zero else '> 0'}")
    return float(value)


@dataclass(frozen=True)
class Price:
    """An hourly price per GPU (US dollars) and where it comes from."""

    usd_per_gpu_hour: float
    source: str

    def __post_init__(self) -> None:
        _positive("usd_per_gpu_hour", self.usd_per_gpu_hour)


#: Prices quoted in the course, each per GPU-hour, with its source.  Prices change; pass your
#: own (``run_cost(..., usd_per_gpu_hour=)``).
PRICES = {
    "aws-p4d-on-demand": Price(
        32.77 / 8, "AWS EC2 p4d.24xlarge (8 x A100-40GB) on-demand, US East (N. Virginia): "
        "$32.77 per instance-hour, the figure of Claim 001-16 (AWS EC2 P4 pricing, 2020-2024)"),
    "aws-p4d-capacity-block": Price(
        14.75 / 8, "AWS EC2 Capacity Blocks for ML pricing page: p4d.24xlarge $14.75 per "
        "instance-hour ($1.844 per A100), US East (Ohio), rates to be updated 1 January 2025"),
    "aws-p5-capacity-block": Price(
        39.33 / 8, "AWS EC2 Capacity Blocks for ML pricing page: p5.48xlarge (8 x H100) $39.33 "
        "per instance-hour ($4.916 per H100), US East, rates to be updated 1 January 2025"),
}


def training_flops(params: float, tokens: float) -> float:
    """``6 N D``: FLOPs to train ``params`` parameters on ``tokens`` tokens (Kaplan et al.
    2020)."""
    return 6.0 * _positive("params", params) * _positive("tokens", tokens)


def _params(model: object) -> float:
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        return _positive("params", model)
    if hasattr(model, "params"):
        return float(model.params)  # type: ignore[attr-defined]
    raise ValueError(f"model must be a labsim.Transformer or a parameter count, got "
                     f"{type(model).__name__}")


def _gpu(device: object) -> GPU:
    if isinstance(device, GPU):
        return device
    if isinstance(device, str):
        return gpu_named(device)
    if hasattr(device, "gpu") and isinstance(device.gpu, GPU):  # a Cluster
        return device.gpu  # type: ignore[attr-defined]
    raise ValueError(f"gpu must be a labsim.GPU, a catalog name or a Cluster, got "
                     f"{type(device).__name__}")


@dataclass(frozen=True)
class RunCost:
    """One training run: ``tokens`` tokens of a ``params``-parameter model on ``gpus`` GPUs
    of ``gpu`` at ``mfu``.  Time, GPU-hours, energy (J and kWh) and dollars follow."""

    params: float
    tokens: float
    gpus: int
    gpu: GPU
    mfu: float
    dtype: str = "bf16"
    power_W: float | None = None
    pue: float = 1.0
    usd_per_gpu_hour: float | None = None
    usd_per_kwh: float | None = None

    def __post_init__(self) -> None:
        _positive("params", self.params)
        _positive("tokens", self.tokens)
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, numbers.Integral) or \
                self.gpus < 1:
            raise ValueError(f"gpus={self.gpus!r}: must be a whole number >= 1")
        if not 0 < _positive("mfu", self.mfu) <= 1:
            raise ValueError(f"mfu={self.mfu!r}: a fraction of peak in (0, 1] (e.g. 0.4)")
        self.gpu.peak(self.dtype)
        if self.power_W is None:
            if self.gpu.tdp_W is None:
                raise ValueError(f"{self.gpu.name} has no board power in the catalog; pass "
                                 "power_W")
            object.__setattr__(self, "power_W", float(self.gpu.tdp_W))
        _positive("power_W", self.power_W)
        if _positive("pue", self.pue) < 1:
            raise ValueError(f"pue={self.pue!r}: power usage effectiveness is >= 1 (1.0: the "
                             "GPUs only)")
        for name in ("usd_per_gpu_hour", "usd_per_kwh"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), allow_zero=True)

    @property
    def flops(self) -> float:
        """``6 N D`` FLOPs."""
        return training_flops(self.params, self.tokens)

    @property
    def wall_s(self) -> float:
        """Seconds of training: FLOPs / (GPUs x dense peak x MFU)."""
        return self.flops / (self.gpus * self.gpu.peak(self.dtype) * self.mfu)

    @property
    def days(self) -> float:
        return self.wall_s / DAY_S

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.wall_s / HOUR_S

    @property
    def energy_J(self) -> float:
        """GPUs x power x time x PUE."""
        return self.gpus * float(self.power_W) * self.wall_s * self.pue  # type: ignore[arg-type]

    @property
    def energy_kWh(self) -> float:
        return self.energy_J / J_PER_KWH

    @property
    def flops_per_J(self) -> float:
        """Useful (model) FLOPs per joule drawn: energy per unit of compute, inverted."""
        return self.flops / self.energy_J

    @property
    def dollars(self) -> float | None:
        """GPU-hours x the hourly price, plus energy x the electricity price, where given."""
        if self.usd_per_gpu_hour is None and self.usd_per_kwh is None:
            return None
        return (self.gpu_hours * (self.usd_per_gpu_hour or 0.0)
                + self.energy_kWh * (self.usd_per_kwh or 0.0))

    def __repr__(self) -> str:
        money = "" if self.dollars is None else f", ${self.dollars:,.0f}"
        return (f"RunCost({self.params / 1e9:.3g}B params x {self.tokens / 1e9:.4g}B tokens on "
                f"{self.gpus} x {self.gpu.name} at MFU {self.mfu:.1%}: {self.days:.3g} days, "
                f"{self.gpu_hours:,.0f} GPU-hours, {self.energy_kWh:,.0f} kWh{money})")


def run_cost(model: object, tokens: float, gpu: object, gpus: int, mfu: float, *,
             dtype: str = "bf16", power_W: float | None = None, pue: float = 1.0,
             usd_per_gpu_hour: float | Price | None = None,
             usd_per_kwh: float | None = None) -> RunCost:
    """The ``RunCost`` of training ``model`` (a ``Transformer`` or a parameter count) on
    ``tokens`` tokens on ``gpus`` GPUs of ``gpu`` (a ``GPU``, a catalog name or a ``Cluster``)
    at ``mfu``.  ``usd_per_gpu_hour`` may be a ``Price`` of ``PRICES``."""
    if isinstance(usd_per_gpu_hour, Price):
        usd_per_gpu_hour = usd_per_gpu_hour.usd_per_gpu_hour
    return RunCost(_params(model), tokens, gpus, _gpu(gpu), mfu, dtype, power_W, pue,
                   usd_per_gpu_hour, usd_per_kwh)


def implied_tokens(model: object, wall_s: float, gpu: object, gpus: int, mfu: float, *,
                   dtype: str = "bf16") -> float:
    """Tokens a run of ``wall_s`` seconds gets through at ``mfu`` (``6 N D`` inverted)."""
    peak = _gpu(gpu).peak(dtype)
    return _positive("wall_s", wall_s) * gpus * peak * _positive("mfu", mfu) / \
        (6.0 * _params(model))


def implied_mfu(model: object, tokens: float, wall_s: float, gpu: object, gpus: int, *,
                dtype: str = "bf16") -> float:
    """The MFU a run of ``tokens`` tokens in ``wall_s`` seconds implies."""
    return training_flops(_params(model), tokens) / (
        _positive("wall_s", wall_s) * gpus * _gpu(gpu).peak(dtype))


def owned_usd_per_gpu_hour(purchase_usd: float, years: float, *, power_W: float,
                           usd_per_kwh: float, pue: float = 1.0,
                           utilisation: float = 1.0, overhead: float = 1.0) -> float:
    """An owned GPU's cost per hour *used*: the purchase spread over ``years`` of service
    (straight-line, no resale, no interest) times ``overhead`` (the rest of the server, the
    network, the building: 1.0 counts the GPU alone), divided by the fraction of hours it is
    busy (``utilisation``), plus its electricity at ``power_W`` x ``pue``."""
    hours = _positive("years", years) * 365.25 * 24
    if not 0 < _positive("utilisation", utilisation) <= 1:
        raise ValueError(f"utilisation={utilisation!r}: the fraction of hours busy, in (0, 1]")
    capital = _positive("purchase_usd", purchase_usd) * _positive("overhead", overhead) / hours
    energy = _positive("power_W", power_W) / 1e3 * _positive("pue", pue) * \
        _positive("usd_per_kwh", usd_per_kwh, allow_zero=True)
    return capital / utilisation + energy
