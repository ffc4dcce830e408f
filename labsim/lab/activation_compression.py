"""Storing saved activations in 8 bits: what it saves, what it costs.

``int8_saved_activations`` installs ``torch.autograd.graph.saved_tensors_hooks`` that keep
every floating activation autograd saves as int8 rows with one fp32 scale per row (symmetric
absmax quantisation) and dequantise it when backward needs it.  Systems that do this in
production (ActNN, Chen et al., ICML 2021; GACT, Liu et al., ICML 2022) use per-group scales
and stochastic rounding so that the compressed gradient stays unbiased; this is the plain
round-to-nearest form, so its gradient error can be measured.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class CompressionStats:
    """Bytes of activations saved for backward: as they were, and as stored after packing."""

    raw_bytes: int = 0
    stored_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def __repr__(self) -> str:
        return (
            f"CompressionStats(raw {self.raw_bytes / 1e6:.2f} MB -> stored "
            f"{self.stored_bytes / 1e6:.2f} MB, {self.ratio:.2f}x smaller)"
        )


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (last dimension): ``q = round(t / s)``, ``s = max|row| / 127``."""
    rows = t.detach().reshape(-1, t.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale = scale / 127.0
    q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_rows``, back to ``like``'s shape and dtype."""
    return (q.float() * scale).reshape(like.shape).to(like.dtype)


@contextmanager
def int8_saved_activations(
    exclude: Sequence[torch.Tensor] = (), min_numel: int = 4096
) -> Iterator[CompressionStats]:
    """Store every floating activation saved for backward as int8 rows plus an fp32 scale.

    Parameters (``exclude``) and small tensors (< ``min_numel`` elements, e.g. LayerNorm's
    mean and rstd) are kept as they are.  Backward sees the dequantised values, so gradients
    carry the quantisation error (up to half a step, max|row|/254, per element).  This is
    the simplest form of what ActNN (Chen et al., ICML 2021) and similar systems do; they add
    per-group scales and stochastic rounding so that the gradient stays unbiased.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    stats = CompressionStats()
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> object:
        ptr = t.untyped_storage().data_ptr()
        fresh = ptr not in seen
        seen.add(ptr)
        if ptr in skip or not t.is_floating_point() or t.numel() < min_numel or t.dim() < 2:
            if fresh and ptr not in skip:
                stats.raw_bytes += t.untyped_storage().nbytes()
                stats.stored_bytes += t.untyped_storage().nbytes()
            return t
        q, scale = quantize_rows(t)
        stats.raw_bytes += t.numel() * t.element_size()
        stats.stored_bytes += q.numel() * q.element_size() + scale.numel() * 4
        return (q, scale, torch.empty(t.shape, dtype=t.dtype, device="meta"))

    def unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, tuple):
            q, scale, like = packed
            return dequantize_rows(q, scale, like)
        return packed  # type: ignore[return-value]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats
