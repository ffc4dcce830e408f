"""The element-wise chain of the kernel-fusion lab, run as separate PyTorch ops.

``bias_gelu_dropout_residual`` is what a transformer block does after its second matmul
(bias, activation, dropout, residual add), written as eager PyTorch runs it: every line is
one operator that reads its inputs from memory and writes a new full-size tensor.  The dropout
keep-mask is an input, so that separate, fused and compiled versions see the same randomness
and can be compared exactly (a fused GPU kernel would draw the mask inside the kernel).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def bias_gelu_dropout_residual(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, keep: torch.Tensor, p: float
) -> torch.Tensor:
    """``residual + dropout(gelu(x + bias))`` with dropout's keep-mask given; one op a line.

    x, residual: (..., h); bias: (h,); keep: bool, shape of x; p: drop probability in [0, 1).
    """
    if not 0 <= p < 1:
        raise ValueError(f"p must be in [0, 1), got {p}")
    t = x + bias  # (..., h), one full-size tensor per line
    t = F.gelu(t)
    t = t * keep
    t = t * (1.0 / (1.0 - p))
    return t + residual


@dataclass(frozen=True)
class ChainInputs:
    """Synthetic inputs for the chain: (rows, hidden) activations and a keep-mask."""

    x: torch.Tensor
    bias: torch.Tensor
    residual: torch.Tensor
    keep: torch.Tensor
    p: float

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.x, self.bias, self.residual, self.keep, self.p)

    @property
    def numel(self) -> int:
        return self.x.numel()


def chain_inputs(
    rows: int,
    hidden: int,
    *,
    p: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ChainInputs:
    """Random inputs (seeded) for ``bias_gelu_dropout_residual``."""
    if rows < 1 or hidden < 1:
        raise ValueError("rows and hidden must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, dtype=dtype)
    bias = torch.randn(hidden, generator=gen, dtype=dtype)
    residual = torch.randn(rows, hidden, generator=gen, dtype=dtype)
    keep = torch.rand(rows, hidden, generator=gen) >= p
    return ChainInputs(x.to(device), bias.to(device), residual.to(device), keep.to(device), p)


@dataclass(frozen=True)
class Compiled:
    """A ``torch.compile``d function and how long its first (compiling) call took."""

    fn: Callable[..., Any]
    first_call_s: float
    code: tuple[str, ...] = ()
    """The source Inductor generated on the first call (one module per compiled graph):
    C++ with OpenMP on a CPU, Python with Triton kernels on a GPU."""

    def kernels(self) -> tuple[str, ...]:
        """Names of the generated kernels, in order of first appearance: ``cpp_fused_...``
        on a CPU, ``triton_...`` on a GPU (Inductor names a fused kernel after its ops)."""
        names: dict[str, None] = {}
        for module in self.code:
            for name in re.findall(r"\b(cpp_fused_\w+|triton_(?:poi|red|per|tem)_\w+)", module):
                names.setdefault(name, None)
        return tuple(names)

    def kernel_source(self, name: str, lines: int = 40) -> str:
        """The first ``lines`` lines of the generated source from the kernel ``name`` on."""
        for module in self.code:
            at = module.find(f"def {name}(") if name.startswith("triton_") else -1
            if at < 0:
                at = module.find("extern \"C\"") if name in module else -1
            if at >= 0:
                return "\n".join(module[at:].splitlines()[:lines])
        raise ValueError(f"no kernel {name!r}; generated: {self.kernels()}")


def compile_and_time(fn: Callable[..., Any], *args: Any, **compile_kwargs: Any) -> Compiled:
    """``torch.compile(fn)``, call it once on ``args`` (this compiles) and time that call.

    The first call traces the function with TorchDynamo and generates code with Inductor
    (C++/OpenMP on a CPU, Triton on a GPU): seconds, not milliseconds.  The generated source
    is kept for reading (``torch._inductor.utils.run_and_get_code``); the on-disk FX-graph and
    AOTAutograd caches are bypassed for this call, since a cache hit generates no source.
    """
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(fn, **compile_kwargs)
    start = time.perf_counter()
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        _, code = run_and_get_code(compiled, *args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return Compiled(compiled, time.perf_counter() - start, tuple(code))
