"""The roofline model (Williams, Waterman & Patterson 2009, CACM 52(4)).

An operation that performs ``flops`` FLOPs and moves ``nbytes`` bytes between memory and the
chip has arithmetic intensity ``I = flops / nbytes`` (FLOP/byte).  A chip with peak compute
``P`` (FLOP/s) and memory bandwidth ``B`` (bytes/s) can at best attain ``min(P, I * B)``; the
op takes at least ``max(flops / P, nbytes / B)``.  The *ridge point* ``P / B`` is the intensity
where the two limits meet: below it an op is memory-bound, above it compute-bound.

A large bf16 matmul (m = n = k = 8192: I ~ 2731 FLOP/byte) is far right of an H100's ridge
(~295 FLOP/byte); an element-wise add of two fp32 vectors (1 FLOP per 12 bytes) is far left
and can use at most 1/3500 of the H100's bf16 peak.

``Roofline`` works for a catalog GPU (``Roofline.of("H100-SXM", "bf16")``) or for any
measured machine (``Roofline("my CPU", peak_flops=..., bandwidth_Bps=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from labsim.hardware import GPU, gpu
from labsim.units import fmt_bandwidth, fmt_flops


@dataclass(frozen=True)
class Roofline:
    """A compute roof ``peak_flops`` (FLOP/s) and a memory slope ``bandwidth_Bps`` (bytes/s)."""

    name: str
    peak_flops: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if not self.peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0 FLOP/s, got {self.peak_flops!r}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"bandwidth_Bps must be > 0 bytes/s, got {self.bandwidth_Bps!r}")

    @classmethod
    def of(cls, device: str | GPU, dtype: str = "bf16") -> Roofline:
        """The roofline of a catalog GPU for ``dtype`` (dense peak, HBM bandwidth)."""
        chip = gpu(device)
        return cls(f"{chip.name} {dtype}", chip.peak(dtype), chip.memory_bandwidth_Bps)

    @property
    def ridge_point(self) -> float:
        """Intensity (FLOP/byte) where the op turns from memory-bound to compute-bound."""
        return self.peak_flops / self.bandwidth_Bps

    def attainable_flops(self, intensity: float) -> float:
        """``min(peak, intensity * bandwidth)`` in FLOP/s."""
        if not intensity >= 0:
            raise ValueError(f"intensity must be >= 0 FLOP/byte, got {intensity!r}")
        return min(self.peak_flops, intensity * self.bandwidth_Bps)

    def op_time(self, flops: float, nbytes: float) -> float:
        """Lower bound on an op's time: ``max(flops / peak, nbytes / bandwidth)`` seconds."""
        _check_work(flops, nbytes)
        return max(flops / self.peak_flops, nbytes / self.bandwidth_Bps)

    def fraction_of_peak(self, flops: float, nbytes: float) -> float:
        """The best fraction of peak FLOP/s the op can reach: ``min(1, I / ridge)``."""
        _check_work(flops, nbytes)
        if flops == 0:
            return 0.0
        return flops / self.op_time(flops, nbytes) / self.peak_flops

    def bound(self, flops: float, nbytes: float) -> str:
        """"compute" or "memory": which roof limits the op."""
        _check_work(flops, nbytes)
        return "compute" if flops / self.peak_flops >= nbytes / self.bandwidth_Bps else "memory"

    def __repr__(self) -> str:
        return (
            f"Roofline({self.name}: {fmt_flops(self.peak_flops)}, "
            f"{fmt_bandwidth(self.bandwidth_Bps)}, ridge {self.ridge_point:.3g} FLOP/byte)"
        )


def _check_work(flops: float, nbytes: float) -> None:
    if not flops >= 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if flops == 0 and nbytes == 0:
        raise ValueError("an op needs flops > 0 or nbytes > 0")


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte moved; ValueError for ``nbytes <= 0``."""
    if not nbytes > 0:
        raise ValueError(f"nbytes must be > 0 to define an intensity, got {nbytes!r}")
    if not flops >= 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    return flops / nbytes


def matmul_flops(m: int, n: int, k: int) -> int:
    """``(m x k) @ (k x n)``: m*n dot products of length k, each k multiplies + k adds."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype_bytes: float = 2) -> float:
    """Minimum memory traffic of a matmul: read A (m x k) and B (k x n), write C (m x n)."""
    return (m * k + k * n + m * n) * dtype_bytes


def attainable_flops(
    intensity: float, device: str | GPU = "H100-SXM", dtype: str = "bf16"
) -> float:
    """Roofline bound in FLOP/s for an op of ``intensity`` FLOP/byte on a catalog GPU."""
    return Roofline.of(device, dtype).attainable_flops(intensity)


def ridge_point(device: str | GPU = "H100-SXM", dtype: str = "bf16") -> float:
    """``peak / bandwidth`` of a catalog GPU, FLOP/byte."""
    return Roofline.of(device, dtype).ridge_point


def op_time(flops: float, nbytes: float, device: str | GPU = "H100-SXM",
            dtype: str = "bf16") -> float:
    """Roofline lower bound on an op's time in seconds on a catalog GPU."""
    return Roofline.of(device, dtype).op_time(flops, nbytes)


def fraction_of_peak(flops: float, nbytes: float, device: str | GPU = "H100-SXM",
                     dtype: str = "bf16") -> float:
    """Best fraction of the dense ``dtype`` peak an op can reach on a catalog GPU."""
    return Roofline.of(device, dtype).fraction_of_peak(flops, nbytes)
