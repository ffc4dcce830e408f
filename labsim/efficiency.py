"""What fraction of a GPU's datasheet peaks its kernels reach: one set of constants per GPU
type (``EFFICIENCY``), each from a measurement with its source.

``labsim.compute`` prices every kernel of a step with them: a GEMM at its size's fraction
of the dense peak (``Efficiency.gemm``), FlashAttention at its kernel's published fraction
(``Efficiency.flash``), memory-bound kernels at a size-dependent fraction of HBM bandwidth
(``MEMORY_SHAPE``), all inside a training step at the software profile's sustained fraction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from labsim.hardware import GPU

# Shape of the GEMM efficiency curve: fraction of the plateau reached by a GEMM of at least
# this many GFLOP (linear in log10 GFLOP in between).  Points from Calculon's A100/H100 system
# files (Isaev et al. 2023, github.com/calculon-ai/calculon systems/a100_80g.json: 128 GFLOP ->
# 0.95, 16 -> 0.90, 1 -> 0.60), divided by their 0.95 plateau so that the plateau itself comes
# from a measurement (``gemm_plateau``).
GEMM_SHAPE: tuple[tuple[float, float], ...] = ((128.0, 1.0), (16.0, 0.947), (1.0, 0.632),
                                               (0.01, 0.105))
# Achieved fraction of HBM bandwidth by transfer size in MB (Calculon, same files, "mem1").
MEMORY_SHAPE: tuple[tuple[float, float], ...] = ((100.0, 0.90), (10.0, 0.75), (1.0, 0.60),
                                                 (0.01, 0.30))
# FlashAttention implementations a software profile can run: "cuda" (Dao's CUDA kernels, the
# GPU's best: FlashAttention-2 on Ampere, FlashAttention-3 on Hopper) or "triton-2022" (Dao's
# Triton kernel of 2022, flash_attn_triton.py, on triton 2.0.0.dev20221202; MosaicML's
# llm-foundry ran a copy of it for attn_impl "triton", its benchmarks' default).
FLASH_KERNELS = ("cuda", "triton-2022")
# Overlapped compute runs this much longer than alone while a collective runs beside it on the
# same GPU: the average over A100, H100, MI250 and MI210 of Lee et al. 2025, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning" (arXiv:2507.03114:
# 18.9 % on average, 40 % at most).  Measured, not fitted.
OVERLAP_SLOWDOWN = 0.189


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of a GPU's datasheet peaks (one set per GPU type).

    gemm_plateau: best large-GEMM throughput / dense peak (bf16/fp16), measured in isolation.
    flash_forward, flash_backward: FlashAttention kernel throughput / dense peak (the
        ``"cuda"`` kernel).
    triton_flash: the ``"triton-2022"`` kernel's forward + backward throughput / dense peak
        by head dimension and sequence length (causal), as (head dim, ((sequence length,
        fraction), ...)) pairs, head dims and lengths descending.
    sustained: fraction of those isolated-kernel rates that a GPU sustains inside a training
        step (gaps between kernels, launch and synchronisation latency, clocks under the
        power draw of compute + HBM + NVLink + NICs together, allocator and framework work).
        No datasheet gives it: it is the one constant fitted to end-to-end measurements.
    source: where each number comes from.
    """

    gemm_plateau: float
    flash_forward: float
    flash_backward: float
    sustained: float
    source: str
    triton_flash: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()
    overlap_slowdown: float = OVERLAP_SLOWDOWN

    def gemm(self, flops: float) -> float:
        """Fraction of dense peak a GEMM of ``flops`` FLOP achieves."""
        return self.gemm_plateau * log_curve(GEMM_SHAPE, flops / 1e9)

    def flash(self, kernel: str, seq_len: int, head_dim: int = 128) -> tuple[float, float]:
        """(forward, backward) fraction of dense peak of FlashAttention ``kernel``
        (``FLASH_KERNELS``) at ``seq_len`` tokens and ``head_dim``; a GPU with no published
        Triton curve gets the CUDA kernel's fractions for both.  Between the published head
        dims the fraction is interpolated linearly, outside them the nearest is taken, and
        beyond the longest published sequence it is held (no measurement goes further)."""
        if kernel not in FLASH_KERNELS:
            raise ValueError(f"flash kernel {kernel!r}: choose one of {FLASH_KERNELS}")
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
        if kernel == "cuda" or not self.triton_flash:
            return self.flash_forward, self.flash_backward
        dims = self.triton_flash
        if head_dim >= dims[0][0]:
            both = log_curve(dims[0][1], seq_len)
        elif head_dim <= dims[-1][0]:
            both = log_curve(dims[-1][1], seq_len)
        else:
            (d_hi, hi), (d_lo, lo) = next(
                (a, b) for a, b in zip(dims, dims[1:]) if b[0] <= head_dim <= a[0])
            w = (head_dim - d_lo) / (d_hi - d_lo)
            both = (1 - w) * log_curve(lo, seq_len) + w * log_curve(hi, seq_len)
        return both, both


_MAMF = ("maximum achievable matmul FLOPS measured by brute-force shape search, S. Bekman, "
         "ml-engineering, compute/accelerator/README.md (CUDA 12.1)")
SUSTAINED_A100 = 0.80  # fitted: Narayanan et al. 2021, Table 1 (tests/test_step.py)
# H100 vs A100 on identical software: MosaicML llm-foundry (scripts/train/benchmarking/
# README.md) ran seven MPT configurations (1B-30B, 8 GPUs, FSDP) on both; measured H100/A100
# tokens/s ratios are 2.12-2.34, the model with equal sustained fractions gives 2.71-2.87:
# H100 sustains 0.80 (0.76-0.83) of A100's fraction (tests/test_step.py prints the pairs).
SUSTAINED_H100 = SUSTAINED_A100 * 0.80
# Forward + backward TFLOP/s of causal attention at 16k / 8k / 4k / 2k / 1k / 512 tokens, head
# dims 128 and 64, read from Dao 2023 (FlashAttention-2, arXiv:2307.08691) as the
# flash-attention repository ships the figures (assets/flash2_a100_fwd_bwd_benchmark.png,
# assets/flash2_h100_fwd_bwd_benchmark.png).  llm-foundry's "triton" kernel is Dao's
# flash_attn_triton.py of 2022, whose docstring puts it "slightly slower" than the CUDA
# FlashAttention of the time forward + backward (llm-foundry warns it "can be faster"): on
# A100 its curve is FlashAttention-1's (Fig. 4d and 4c).  The figure's "FlashAttention Triton"
# bars are another kernel, OpenAI's triton.ops.flash_attention (the repository's
# benchmarks/benchmark_flash_attention.py imports it).  On H100 it is FlashAttention-2's (Fig.
# 7d and 7c), chosen on the calibration runs (docs/step.md).
_SEQ = (16384, 8192, 4096, 2048, 1024, 512)
_FA1_A100_TFLOPS = MappingProxyType({128: (83.0, 80.0, 76.0, 69.0, 62.0, 55.0),
                                     64: (97.0, 92.0, 87.0, 77.0, 70.0, 58.0)})
_FA2_H100_TFLOPS = MappingProxyType({128: (328.0, 308.0, 294.0, 265.0, 221.0, 163.0),
                                     64: (284.0, 273.0, 257.0, 232.0, 192.0, 141.0)})


def _fraction(tflops: Mapping[int, tuple[float, ...]], peak_tflops: float
              ) -> tuple[tuple[int, tuple[tuple[float, float], ...]], ...]:
    return tuple((d, tuple((n, t / peak_tflops) for n, t in zip(_SEQ, tflops[d])))
                 for d in sorted(tflops, reverse=True))


_A100 = Efficiency(
    0.859, 0.70, 0.55, SUSTAINED_A100,
    f"GEMM plateau 267.9 / 312 TFLOP/s, {_MAMF}; FlashAttention-2 on A100, head dim 128: "
    "forward ~70 %, backward ~55 % of peak (Dao 2023, Fig. 4-6); llm-foundry's Triton kernel "
    "of 2022 at FlashAttention-1's speed: 55-83 TFLOP/s forward + backward at 512-16k tokens "
    "with head dim 128, 58-97 with 64 (Dao 2023, Fig. 4d, 4c); sustained "
    "fraction fitted once to the ten runs of Narayanan et al. 2021, Table 1 (1.7B-1T GPT on "
    "32-3072 A100); overlap slowdown 18.9 % (Lee et al. 2025)",
    triton_flash=_fraction(_FA1_A100_TFLOPS, 312.0),
)
_H100 = Efficiency(
    0.801, 0.65, 0.45, SUSTAINED_H100,
    f"GEMM plateau 792.1 / 989 TFLOP/s, {_MAMF}; FlashAttention-3 on H100 SXM, head dim "
    "128, seq 2k: forward ~650, backward ~450 TFLOP/s (Shah et al. 2024, Fig. 5-6); "
    "sustained fraction = A100's x 0.80, the H100/A100 speed ratio measured on identical "
    "software (MosaicML llm-foundry benchmarks, 7 paired runs) over the modelled one; the "
    "Triton kernel of 2022 has no published H100 measurement: FlashAttention-2's H100 curve "
    "(Dao 2023, Fig. 7d, 7c), the fastest kernel on the Ampere instructions both use, chosen on "
    "the calibration runs over FlashAttention-1's (docs/step.md); overlap slowdown 18.9 % "
    "(Lee et al. 2025)",
    triton_flash=_fraction(_FA2_H100_TFLOPS, 989.0),
)
_GENERIC = Efficiency(
    0.80, 0.55, 0.45, SUSTAINED_A100,
    "no published measurement for this GPU: H100-like kernel fractions and the A100 "
    "sustained fraction assumed",
)
EFFICIENCY: Mapping[str, Efficiency] = MappingProxyType({
    "a100-40gb": _A100,
    "a100-80gb": _A100,
    "h100-sxm": _H100,
    "h100-pcie": _H100,
    "h100-sxm-hbm2e": _H100,
    "h100-nvl": _H100,
    "h800": _H100,
    "h200": _H100,
})


def efficiency(gpu: GPU) -> Efficiency:
    """The efficiency constants of ``gpu`` (a generic set when none is published)."""
    return EFFICIENCY.get(gpu.name.lower(), _GENERIC)


def log_curve(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear in log10(x) through ``points`` (descending x), clamped at both ends."""
    if x >= points[0][0]:
        return points[0][1]
    for (x_hi, y_hi), (x_lo, y_lo) in zip(points, points[1:]):
        if x >= x_lo:
            w = (math.log10(x) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo))
            return y_lo + w * (y_hi - y_lo)
    return points[-1][1]
