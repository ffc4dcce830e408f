"""Ops timed on the machine a lab runs on and placed on its measured roofline.

An ``Op`` is a call with its work counted: the FLOPs it performs and the bytes it must move at
the least (Williams, Waterman & Patterson 2009, CACM 52(4): the roofline's two axes).  A lab
builds its own ops (``matmul_op`` with the learner's FLOP and byte count, ``add_op``,
``copy_op``; ``in_cache_numel`` and ``main_memory_numel`` size them for a cache), times them
with the learner's timer and places them on the roofline the learner measured;
``placement_rows`` turns that placement into lines of a table.

``time_matmul_dtypes`` times one matmul in fp32, in fp32 with TF32 allowed and in bf16, in
interleaved rounds on one thread (``labsim.lab.timing``), so ``labsim.lab.compare`` can say
which is faster -- or that the rounds disagree -- on a busy machine too; ``bf16_reading``
says in words what the comparison means given the bf16 units the CPU reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from labsim.lab.device import Timing
from labsim.lab.timing import Comparison, one_thread, time_interleaved
from labsim.units import fmt_flops, fmt_time


@dataclass(frozen=True)
class Op:
    """One operation to time: ``run()`` does it once; ``flops`` (FLOP) is the arithmetic it
    performs and ``nbytes`` (bytes) the memory traffic it needs at the least (inputs read and
    outputs written once)."""

    name: str
    run: Callable[[], Any]
    flops: float
    nbytes: float

    def __post_init__(self) -> None:
        if not self.flops >= 0 or not self.nbytes >= 0 or self.flops + self.nbytes == 0:
            raise ValueError(f"op {self.name!r}: flops and nbytes must be >= 0, not both 0 "
                             f"(got {self.flops!r}, {self.nbytes!r})")


def matmul_op(m: int, n: int, k: int, cost: Callable[[int, int, int, int], tuple[float, float]],
              device: torch.device | str = "cpu", seed: int = 0) -> Op:
    """``(m x k) @ (k x n)`` in fp32 on ``device``, its FLOPs and bytes from ``cost(m, n, k,
    dtype_bytes) -> (flops, nbytes)`` (the lab's ``matmul_cost``)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(device)
    b = torch.randn(k, n, generator=gen).to(device)
    flops, nbytes = cost(m, n, k, 4)
    name = f"matmul {m}x{n}x{k}" if len({m, n, k}) > 1 else f"matmul {m}"
    return Op(name, lambda: a @ b, flops, nbytes)


def add_op(numel: int, device: torch.device | str = "cpu") -> Op:
    """``torch.add(a, b, out=c)`` on fp32 vectors of ``numel`` elements: 1 FLOP and 12 bytes
    (two 4-byte reads, one 4-byte write) per element."""
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    out = torch.empty_like(a)
    return Op(f"add {numel:,}", lambda: torch.add(a, b, out=out), numel, 12 * numel)


def copy_op(numel: int, device: torch.device | str = "cpu") -> Op:
    """``dst.copy_(src)`` of ``numel`` fp32 elements: no FLOPs, 8 bytes per element (read once,
    written once), as STREAM counts its Copy kernel (McCalpin, STREAM benchmark: the bytes
    a kernel needs, not the extra read of write-allocate)."""
    src, dst = torch.ones(numel, device=device), torch.empty(numel, device=device)
    return Op(f"copy {numel:,}", lambda: dst.copy_(src), 0, 8 * numel)


def main_memory_numel(cache_bytes: int | None, unknown: int = 2**24) -> int:
    """Elements of an fp32 vector large enough to measure main memory: the smallest power of
    two whose 4-byte elements fill at least twice ``cache_bytes`` (the last-level cache),
    between 2^22 and 2^26; ``unknown`` where the cache size is not reported."""
    if cache_bytes is None:
        return unknown
    numel = 2 ** max(0, (2 * cache_bytes // 4 - 1).bit_length())
    return min(2**26, max(2**22, numel))


def in_cache_numel(cache_bytes: int | None, unknown: int = 2**14) -> int:
    """Elements of the fp32 vectors of an add whose three vectors (two inputs, one output) fill
    at most 3/4 of a cache of ``cache_bytes`` (a core's L2): the largest such power of two, at
    least 2^10; ``unknown`` where the cache size is not reported."""
    if cache_bytes is None:
        return unknown
    return 2 ** max(10, (3 * cache_bytes // 4 // 12).bit_length() - 1)


def placement_rows(placement: Mapping[str, Any]) -> list[str]:
    """Lines of a table of a placement (``{"peak_flops", "bandwidth_Bps", "ops": {name:
    {"time_s", "intensity", "achieved_flops", "fraction", "roofline", "measured"}}}``): per
    op its median time, intensity, achieved FLOP/s, the fraction of the roofline reached,
    the bound the roofline predicts and the one the measurement shows."""
    rows = [f"{'op':24} {'time':>10} {'FLOP/byte':>9} {'achieved':>14} {'of roof':>8} "
            f"{'roofline says':>13} {'measured':>9}"]
    for name, p in placement["ops"].items():
        flag = "" if p["measured"] == p["roofline"] else "  <-"
        rows.append(f"{name:24} {fmt_time(p['time_s']):>10} {p['intensity']:9.2f} "
                    f"{fmt_flops(p['achieved_flops']):>14} {p['fraction']:8.0%} "
                    f"{p['roofline']:>13} {p['measured']:>9}{flag}")
    return rows


def time_matmul_dtypes(n: int, device: torch.device | str = "cpu", rounds: int = 7,
                       seed: int = 0) -> dict[str, Timing]:
    """An ``n x n`` matmul timed in ``rounds`` interleaved rounds on one thread: ``"fp32"``
    (``torch.get_float32_matmul_precision() == "highest"``, PyTorch's default), ``"fp32, TF32
    allowed"`` (``"high"``, which PyTorch's documentation of
    ``torch.set_float32_matmul_precision`` says currently affects CUDA only) and ``"bf16"``.
    The precision setting in force before the call is restored after it."""
    gen = torch.Generator().manual_seed(seed)
    a32 = torch.randn(n, n, generator=gen).to(device)
    a16 = a32.to(torch.bfloat16)
    before = torch.get_float32_matmul_precision()

    def with_precision(precision: str, a: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            torch.set_float32_matmul_precision(precision)
            try:
                return a @ a
            finally:
                torch.set_float32_matmul_precision(before)
        return run

    fns = {"fp32": with_precision("highest", a32),
           "fp32, TF32 allowed": with_precision("high", a32),
           "bf16": with_precision("highest", a16)}
    with one_thread():
        return time_interleaved(fns, device=device, rounds=rounds)


def bf16_reading(bf16_vs_fp32: Comparison, units: list[str] | None, capability: str) -> str:
    """What the comparison of a bf16 and an fp32 matmul on a CPU means, in words.

    ``units``: the bf16 units the CPU reports (``labsim.lab.cpu_bf16_units``: AVX-512 BF16,
    AMX BF16; None where the system does not say); ``capability``: PyTorch's vector code on
    it (``torch.backends.cpu.get_cpu_capability()``).  Facts quoted: one 512-bit
    ``VDPBF16PS`` multiplies 32 pairs of bf16 values and accumulates them into 16 fp32 sums,
    twice the multiplies of a 512-bit fp32 FMA (Intel 64 and IA-32 Architectures Software
    Developer's Manual, vol. 2); AMX's ``TDPBF16PS`` multiplies whole tiles (Intel
    Architecture Instruction Set Extensions Programming Reference, ch. 3); PyTorch runs a bf16
    matmul in oneDNN only where oneDNN reports bf16 support (AVX-512 BW, VL and DQ, or
    AVX-NE-CONVERT: ``mkldnn_bf16_device_check``, ATen ``native/mkldnn/Utils.h``), else in
    ATen's portable loops, which convert every value to fp32 (``native/cpu/BlasKernel.cpp``).
    """
    cmp = bf16_vs_fp32
    said = ("does not report its bf16 units" if units is None
            else f"reports {', '.join(units)}" if units else "reports no bf16 unit")
    if not cmp.settled:
        return ("No verdict on bf16: the rounds disagreed; rerun on a quieter machine. "
                f"This CPU {said}.")
    if cmp.same_speed:
        return (f"bf16 and fp32 took the same time here. This CPU {said}: bf16 saves memory "
                "and bandwidth, but on this product it bought no arithmetic speed.")
    if cmp.fast == "bf16":
        why = (f"its {' and '.join(units)} multiply bf16 in hardware: one 512-bit AVX-512 "
               "BF16 instruction does 32 bf16 multiplies where an fp32 FMA of the same width "
               "does 16, and AMX multiplies whole tiles" if units else
               f"it {said}, so the gain comes from PyTorch's bf16 path ({capability} vector "
               "code), not from a bf16 unit")
        return f"bf16 ran {cmp.ratio:.1f}x faster than fp32 on this CPU: {why}."
    why = (f"This CPU {said}: before it multiplies, every bf16 value is converted to fp32 -- "
           f"in oneDNN's kernels where PyTorch uses them (AVX-512 or AVX-NE-CONVERT CPUs), in "
           f"ATen's portable loops otherwise (this CPU's vector code: {capability}) --, "
           "while fp32 runs in the BLAS library's blocked, vectorised kernel (which library: "
           "`torch.__config__.show()`)" if not units else
           f"This CPU {said}, yet bf16 was slower here: PyTorch's bf16 path did not use them "
           "for this product")
    return f"bf16 ran {cmp.ratio:.0f}x slower than fp32. {why}."
