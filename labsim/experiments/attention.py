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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def flash_loss_curves(steps: int = 30, seed: int = 0) -> dict[str, list[float]]:
    """Training losses of the same small GPT (``labsim.lab.GPT``, 2 layers, width 64, 64
    tokens) from the same initialisation on the same batch, with written-out attention and
    with ``F.scaled_dot_product_attention`` (``flash=True``; PyTorch's flash kernel on a CPU,
    FlashAttention-2 or memory-efficient on CUDA): {"standard": [...], "flash": [...]}.  If
    flash attention approximated, the curves would drift apart; they differ by rounding."""
    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT
    from labsim.workload import Transformer

    cfg = Transformer(layers=2, hidden=64, heads=4, seq_len=64, vocab=128)
    idx, targets = random_batch(cfg, batch=8, seed=seed)  # one batch: the loss must fall
    curves: dict[str, list[float]] = {}
    for name, flash in (("standard", False), ("flash", True)):
        torch.manual_seed(seed)
        model = GPT(cfg, flash=flash)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(steps):
            _, loss = model(idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name] = losses
    return curves


def triton_available() -> str | None:
    """None when Triton can run the kernel here, else the reason it cannot (to print or skip
    on): Triton missing, or older than 3.4 (3.3.1 has no ``triton.knobs``, which
    ``triton_flash_forward`` sets)."""
    try:
        import triton
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"triton is not installed ({exc}); CUDA builds of torch bring it"
    if not hasattr(triton, "knobs"):
        return (f"triton {getattr(triton, '__version__', '?')} has no triton.knobs: the kernel "
                "needs Triton 3.4 or newer (pip install 'triton>=3.4', or a newer torch)")
    return None


def triton_flash_forward(interpret: bool | None = None
                         ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The FlashAttention-2 forward kernel (``_triton_attention``), jitted, as
    ``run(q, k, v, is_causal=False, block_m=64, block_n=64) -> (O, L)`` for q (..., Nq, d),
    k and v (..., Nk, d) of one dtype on one device: O like q, L = logsumexp of each row of
    scores (..., Nq) in fp32.  Accumulation is fp32 whatever the inputs (fp32 products in
    IEEE precision, not TF32).

    ``interpret=None`` compiles the kernel for a CUDA tensor's GPU and runs it in Triton's
    interpreter (numpy, on the CPU) for CPU tensors; ``True``/``False`` force one.  The
    setting is scoped (``triton.knobs.runtime.scope``): nothing outside this call changes.
    Interpreted timings mean nothing -- the interpreter runs every program one after the
    other in numpy."""
    import triton

    from labsim.experiments._triton_attention import _fa2_forward

    kernels: dict[bool, Any] = {}

    def kernel(interpreted: bool) -> Any:
        if interpreted not in kernels:
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = interpreted
                kernels[interpreted] = triton.jit(_fa2_forward)
        return kernels[interpreted]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
            block_m: int = 64, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        if not (q.dtype == k.dtype == v.dtype) or k.shape != v.shape or (
                q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]):
            raise ValueError("q (..., Nq, d), k and v (..., Nk, d) must share batch dims, d "
                             "and dtype")
        interpreted = q.device.type != "cuda" if interpret is None else interpret
        *batch, n_q, d = q.shape
        n_k = k.shape[-2]
        heads = math.prod(batch)
        # Triton 3.9's interpreter misreads bf16 memory (numpy has no bf16): there the
        # kernel runs on an exact fp32 copy, and O is rounded to bf16 at the end.
        work = torch.float32 if interpreted and q.dtype == torch.bfloat16 else q.dtype
        qc, kc, vc = (t.reshape(heads, -1, d).to(work).contiguous() for t in (q, k, v))
        out = torch.empty_like(qc)
        lse = torch.empty(heads, n_q, device=q.device, dtype=torch.float32)
        grid = (triton.cdiv(n_q, block_m), heads)
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpreted
            kernel(interpreted)[grid](
                qc, kc, vc, out, lse, n_q, n_k, d, 1.0 / math.sqrt(d),
                CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=max(16, triton.next_power_of_2(d)),
                PRECISION="ieee" if work in (torch.float32, torch.float64) else "tf32")
        return out.to(q.dtype).reshape(q.shape), lse.reshape(*batch, n_q)

    return run
