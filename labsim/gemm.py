"""One matrix multiplication of a model's step, as the roofline and the compute model see it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gemm:
    """One (batched) matrix multiplication ``(m x k) @ (k x n)``, repeated ``batch`` times.

    ``flops`` is ``2 * batch * m * n * k``; ``nbytes(dtype_bytes)`` the minimum traffic of
    reading both operands and writing the result once (the roofline's byte count).
    """

    name: str
    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def nbytes(self, dtype_bytes: float = 2) -> float:
        return self.batch * (self.m * self.k + self.k * self.n + self.m * self.n) * dtype_bytes

    def intensity(self, dtype_bytes: float = 2) -> float:
        """Arithmetic intensity in FLOP per byte of memory traffic."""
        return self.flops / self.nbytes(dtype_bytes)
