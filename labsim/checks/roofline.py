"""Checks for the roofline lab: FLOP and byte counts, roofline time, MFU.

Every reference is labsim's own closed form (``labsim.roofline``), so the course and the
library cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labsim.checks._core import Case, close, raises, run_check
from labsim.roofline import Roofline
from labsim.roofline import matmul_bytes as _matmul_bytes
from labsim.roofline import matmul_flops as _mm_flops

_CPU = Roofline("a 2-core CPU", 100e9, 20e9)
_H100 = Roofline.of("H100-SXM", "bf16")
_A100 = Roofline.of("A100-80GB", "bf16")


def matmul_flops(fn: Callable[[int, int, int], Any]) -> None:
    """``fn(m, n, k)`` = FLOPs of (m x k) @ (k x n): 2mnk."""
    shapes = [(1, 1, 1), (2, 3, 4), (4, 3, 2), (1, 4096, 4096), (4096, 4096, 4096),
              (0, 7, 9), (8192, 1, 1024)]
    cases = [Case(f"m, n, k = {s}", s, expected=_mm_flops(*s)) for s in shapes]
    run_check("matmul_flops", fn, cases, compare=close(rtol=0))


def matmul_bytes(fn: Callable[[int, int, int, int], Any]) -> None:
    """``fn(m, n, k, dtype_bytes)`` = bytes to read A and B and write C once."""
    shapes = [(1, 1, 1, 4), (2, 3, 4, 4), (2, 3, 4, 2), (4096, 4096, 4096, 2),
              (1, 4096, 4096, 4), (8192, 1, 1024, 1), (0, 5, 5, 4)]
    cases = [Case(f"m, n, k, dtype_bytes = {s}", s, expected=_matmul_bytes(*s)) for s in shapes]
    run_check("matmul_bytes", fn, cases, compare=close(rtol=0))


def roofline_time(fn: Callable[[float, float, float, float], Any]) -> None:
    """``fn(flops, nbytes, peak_flops, bandwidth_Bps)`` = max(flops/peak, nbytes/bandwidth)."""
    work = [
        ("compute-bound matmul on an H100", _mm_flops(8192, 8192, 8192),
         _matmul_bytes(8192, 8192, 8192, 2), _H100),
        ("memory-bound fp32 add on an H100", 1e8, 12e8, _H100),
        ("matrix-vector on an A100", _mm_flops(1, 4096, 4096),
         _matmul_bytes(1, 4096, 4096, 2), _A100),
        ("exactly at the ridge point", 100e9, 20e9, _CPU),
        ("no FLOPs at all (a copy)", 0.0, 4e9, _CPU),
        ("no bytes (all in registers)", 1e12, 0.0, _CPU),
    ]
    cases = [
        Case(name, (f, b, r.peak_flops, r.bandwidth_Bps), expected=r.op_time(f, b))
        for name, f, b, r in work
    ]
    run_check("roofline_time", fn, cases, compare=close(rtol=1e-9))


def attainable_flops(fn: Callable[[float, float, float], Any]) -> None:
    """``fn(intensity, peak_flops, bandwidth_Bps)`` = min(peak, intensity * bandwidth)."""
    cases = [
        Case(f"I = {i} FLOP/byte on {r.name}", (i, r.peak_flops, r.bandwidth_Bps),
             expected=r.attainable_flops(i))
        for i, r in [(0.0, _H100), (1 / 12, _H100), (_H100.ridge_point, _H100), (1e4, _H100),
                     (50.0, _A100), (1.0, _CPU), (5.0, _CPU)]
    ]
    run_check("attainable_flops", fn, cases, compare=close(rtol=1e-9))


def mfu(fn: Callable[[float, float, float], Any]) -> None:
    """``fn(model_flops, step_time_s, peak_flops)`` = achieved model FLOP/s over peak; a
    non-positive time or peak must raise ValueError."""
    good = [
        ("Megatron 1T on A100: 163 TFLOP/s", 163e12, 1.0, 312e12),
        ("PaLM-like step: 46 % ", 0.462 * 275e12 * 2.5, 2.5, 275e12),
        ("an idle step", 0.0, 1.0, 312e12),
        ("tiny CPU step", 3e9, 0.05, 100e9),
    ]
    cases = [Case(n, (f, t, p), expected=f / t / p) for n, f, t, p in good]
    cases += [
        Case("zero step time raises ValueError", (1e9, 0.0, 1e12), compare=raises(ValueError)),
        Case("negative peak raises ValueError", (1e9, 1.0, -1.0), compare=raises(ValueError)),
    ]
    run_check("mfu", fn, cases, compare=close(rtol=1e-9))


def mlp_step_flops(fn: Callable[[list[int], int], Any]) -> None:
    """``fn(sizes, batch)`` = model FLOPs of one training step of an MLP with layer widths
    ``sizes`` (Linear(sizes[i], sizes[i+1]) for each i): 3 x forward = 6 * batch * sum(in*out)."""
    specs = [([4, 3], 1), ([4, 3], 10), ([512, 2048, 512], 64), ([10, 10, 10, 10], 7),
             ([784, 256, 10], 128), ([1, 1], 1)]
    cases = [
        Case(f"sizes={s}, batch={b}", (s, b),
             expected=6 * b * sum(i * o for i, o in zip(s[:-1], s[1:])))
        for s, b in specs
    ]
    run_check("mlp_step_flops", fn, cases, compare=close(rtol=0))
