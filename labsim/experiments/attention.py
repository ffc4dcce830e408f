"""Attention in PyTorch for the flash-attention lab: which SDPA kernel runs, and what goes
wrong when a tiled softmax forgets to rescale.

``F.scaled_dot_product_attention`` (SDPA) picks one of several kernels per call: a
FlashAttention kernel (CUDA on sm80 and newer, and a CPU flash kernel), the memory-efficient
kernel of xFormers (Rabe & Staats 2021; CUDA sm50 and newer), cuDNN's fused attention, or the
"math" fallback that materialises the N x N matrix.  ``sdpa_backend`` tells which one ran by
profiling the call and reading the ATen operator's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from labsim.lab.profile import quiet_profiler

# ATen operator that SDPA dispatches to -> backend name (PyTorch 2.2 and newer).
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


@dataclass(frozen=True)
class SdpaChoice:
    """The SDPA backend one call used, by its ATen operator."""

    backend: str
    aten_op: str
    device: str
    dtype: str

    def __repr__(self) -> str:
        return f"SdpaChoice({self.backend} via {self.aten_op} on {self.device}, {self.dtype})"


def sdpa_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
) -> SdpaChoice:
    """Run SDPA once on ``q, k, v`` under the profiler and report the kernel it chose."""
    activities = [ProfilerActivity.CPU]
    with quiet_profiler(), profile(activities=activities) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for event in prof.events():
        if event.name in SDPA_OPS:
            return SdpaChoice(SDPA_OPS[event.name], event.name, str(q.device), str(q.dtype))
    return SdpaChoice("unknown", "", str(q.device), str(q.dtype))


def per_block_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
) -> torch.Tensor:
    """The tiling of the seed article's Triton sketch: softmax *within* each key block, summed.

    Each block's softmax is normalised by that block's own sum, and partial outputs are added
    without the rescaling of the online-softmax recurrence.  This is *not* attention: the
    result is off by far more than rounding (it is what "approximate" would mean).  Shapes
    ``(..., N, d)``; non-causal.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    for start in range(0, k.shape[-2], block):
        kb = k[..., start:start + block, :]
        vb = v[..., start:start + block, :]
        out = out + torch.softmax(q @ kb.transpose(-1, -2) * scale, dim=-1) @ vb
    return out
