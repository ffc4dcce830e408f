"""The element-wise chain of the kernel-fusion lab, run as separate PyTorch ops.

``bias_gelu_dropout_residual`` is what a transformer block does after its second matmul
(bias, activation, dropout, residual add), written as eager PyTorch runs it: every line is
one operator that reads its inputs from memory and writes a new full-size tensor.  The dropout
keep-mask is an input, so that separate, fused and compiled versions see the same randomness
and can be compared exactly.  A fused Triton kernel draws its mask inside the kernel instead,
from a seed (``tl.rand``, as Triton's low-memory dropout tutorial does);
``triton_rand`` computes the same numbers here, so ``dropout_keep`` is the mask such a
kernel applies.

``time_add_sizes`` times the simplest op at several sizes, one call at a time and queued,
interleaved round by round (``labsim.lab.timing``), for the launch-overhead model.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from labsim.lab.device import Timing


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


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) as
# Triton 3.9 runs it for 32-bit offsets (triton/language/random.py: philox_impl, randint,
# uint_to_uniform_float): counter (offset, 0, 0, 0), key (seed low, seed high 32 bits).
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # the round multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85      # the key increments (Weyl sequence)
_ROUNDS = 10
_U32 = 0xFFFFFFFF
_UNIFORM_SCALE = 4.6566127342e-10  # uint_to_uniform_float: largest s with (2**31 - 1) s < 1


def _mulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    """High 32 bits of the 64-bit product a * b (a, b < 2**32) in int64, without overflow:
    b split into 16-bit halves."""
    return (a * (b >> 16) + ((a * (b & 0xFFFF)) >> 16)) >> 16


def _mullo(a: int, b: torch.Tensor) -> torch.Tensor:
    """Low 32 bits of a * b (a, b < 2**32) in int64, without overflow."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _U32


def triton_rand(seed: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 numbers ``tl.rand(seed, offsets)`` returns for offsets ``0 .. numel - 1``:
    uniform in [0, 1), one per element, the same on every device and in Triton's interpreter.

    ``seed`` is the kernel's integer argument (64 bits: its low and high halves are Philox's
    key); the offset is the counter, so element ``i`` of a tensor gets the same number
    whichever program of whatever block size draws it."""
    offsets = torch.arange(numel, dtype=torch.int64, device=device)
    seed &= 0xFFFFFFFFFFFFFFFF  # a negative seed as Triton widens it: two's complement
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1 = offsets & _U32, offsets >> 32
    c2 = c3 = torch.zeros_like(offsets)
    for _ in range(_ROUNDS):
        c0, c1, c2, c3 = (_mulhi(_ROUND_B, c2) ^ c1 ^ k0, _mullo(_ROUND_B, c2),
                          _mulhi(_ROUND_A, c0) ^ c3 ^ k1, _mullo(_ROUND_A, c0))
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # the bits read as int32
    folded = torch.where(signed < 0, -signed - 1, signed)  # ~x for x < 0: 0 .. 2**31 - 1
    return folded.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def dropout_keep(seed: int, shape: Sequence[int], p: float,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The keep-mask of a kernel that keeps element ``i`` (row-major) when
    ``tl.rand(seed, i) > p``: bool, ``shape``; compared in float32, as the kernel does."""
    numel = math.prod(shape)
    rand = triton_rand(seed, numel, device)
    return (rand > torch.tensor(p, dtype=torch.float32, device=device)).reshape(tuple(shape))


def calls_for(fn: Callable[[], Any], batch_s: float,
              device: torch.device | str = "cpu") -> int:
    """How many back-to-back calls of ``fn`` take about ``batch_s`` seconds (1 to 1000), from
    the fastest of three synchronised calls."""
    from labsim.lab.device import synchronize

    fn()  # warm up
    synchronize(device)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(1, min(1000, round(batch_s / max(best, 1e-7))))


def time_per_call(fns: Mapping[str, Callable[[], Any]], *,
                  device: torch.device | str = "cpu", rounds: int = 9, batch_s: float = 3e-4,
                  single: Sequence[str] = (), max_seconds: float | None = None
                  ) -> dict[str, Timing]:
    """Seconds per call of each of ``fns``, interleaved round by round
    (``labsim.lab.timing.time_interleaved``, so ``compare`` can pair the rounds).

    Each round issues about ``batch_s`` worth of back-to-back calls of a function and waits
    for them once (a *queue* of calls: on a GPU, launches overlap the kernels before them):
    enough calls to spread the timer's own cost (clock reads, the synchronise) over many,
    few enough that the operating system seldom pauses the thread in the middle of a round --
    a long round on a busy machine times other processes' time slices too.  The functions
    named in ``single`` are timed one synchronised call per round instead: their *latency*,
    launch, run, wait and the timer's cost included."""
    from labsim.lab.timing import time_interleaved

    calls = {name: 1 if name in single else calls_for(fn, batch_s, device)  # warms it up
             for name, fn in fns.items()}
    for name in single:
        fns[name]()  # warm up

    def batch(fn: Callable[[], Any], n: int) -> Callable[[], Any]:
        if n == 1:
            return fn

        def run() -> None:
            for _ in range(n):
                fn()
        return run

    timed = time_interleaved({name: batch(fn, calls[name]) for name, fn in fns.items()},
                             device=device, rounds=rounds, warmup=0, max_seconds=max_seconds)
    return {name: Timing(tuple(t / calls[name] for t in timing.times_s))
            for name, timing in timed.items()}


@dataclass(frozen=True)
class SizeTimings:
    """``a + b`` on fp32 tensors of ``numel`` elements, in the same rounds: one synchronised
    call at a time (``latency``) and a queue of calls (``queued``, seconds per call)."""

    numel: int
    nbytes: int  # read a and b, write the sum (fp32)
    latency: Timing
    queued: Timing


def time_add_sizes(numels: Sequence[int], *, device: torch.device | str = "cpu",
                   rounds: int = 9, batch_s: float = 3e-4,
                   max_seconds: float | None = None) -> list[SizeTimings]:
    """Time ``a + b`` at each size, latency and queued (``time_per_call``), every size and
    both ways interleaved in the same rounds: a load that comes and goes slows them alike."""
    fns: dict[str, Callable[[], Any]] = {}
    for n in numels:
        a, b = torch.randn(n, device=device), torch.randn(n, device=device)
        fns[f"latency {n}"] = fns[f"queued {n}"] = _adder(a, b)
    timed = time_per_call(fns, device=device, rounds=rounds, batch_s=batch_s,
                          single=[f"latency {n}" for n in numels], max_seconds=max_seconds)
    return [SizeTimings(n, 3 * 4 * n, timed[f"latency {n}"], timed[f"queued {n}"])
            for n in numels]


def _adder(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: a + b


def fmt_timing(timing: Timing) -> str:
    """``median [lower quartile-upper quartile]`` of a timing's rounds, e.g.
    ``12.3 us [11.9 us-13.0 us]``."""
    from labsim.lab.timing import spread
    from labsim.units import fmt_time

    low, high = spread(timing.times_s)
    return f"{fmt_time(timing.median_s)} [{fmt_time(low)}-{fmt_time(high)}]"
