"""Attention's cost: FLOPs, HBM traffic and activation memory of standard vs tiled attention.

Standard attention (Dao et al. 2022, "FlashAttention", Algorithm 0) runs three kernels and
round-trips the N x N score matrix through HBM::

    S = Q K^T            read Q, K (2Nd)     write S (N^2)
    P = softmax(S)       read S (N^2)        write P (N^2)
    O = P V              read P, V (N^2+Nd)  write O (Nd)

so it moves 4Nd + 4N^2 elements per (batch, head): Theta(Nd + N^2).  Every extra element-wise
pass over S in an unfused implementation (scaling, the causal mask, dropout) adds 2N^2.

Tiled attention (FlashAttention) keeps a block of queries and a block of keys/values in on-chip
SRAM of M elements and never writes S or P.  With the loop order of FlashAttention-1
(Algorithm 1: outer loop over key/value blocks of Bc rows, inner loop over query blocks of Br
rows) K and V are read once and Q, O (and the running max m and sum l) are streamed once per
key/value block, Tc = ceil(N/Bc) times; with block sizes Bc = ceil(M/(4d)), Br = min(Bc, d) this
is Theta(N^2 d^2 / M) (Theorem 2).  FlashAttention-2 swaps the loops (queries outer): Q and O
move once and K, V are streamed once per query block.  Both are exact: the same sums, in a
different order.

Times are placed on the roofline of a catalog GPU: each kernel takes
``max(flops / peak, bytes / bandwidth)``.  Softmax FLOPs are not counted (they are O(N^2), next
to the O(N^2 d) of the two matmuls).  Traffic between SRAM and L2 is not modelled: the model
counts what crosses the HBM interface if nothing is cached, as the paper does.

Memory: FlashAttention saves no N x N matrix for the backward pass (it recomputes S and P from
Q, K, V and the per-row log-sum-exp), which is what ``labsim.memory.activation_per_layer``
with ``recompute="selective"`` drops from Korthikanti et al.'s ``sbh(34 + 5as/h)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labsim.hardware import GPU, gpu
from labsim.roofline import Roofline

LOOP_ORDERS = ("kv_outer", "q_outer")
STATS_BYTES = 4  # the running max, sum and log-sum-exp are kept in fp32 by every kernel


def _positive_int(name: str, value: int) -> None:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def attention_flops(
    seq_len: int, head_dim: int, *, heads: int = 1, batch: int = 1, causal: bool = False
) -> float:
    """Matmul FLOPs of one attention forward: 2N^2 d for QK^T plus 2N^2 d for PV, per head.

    With a causal mask only the N(N+1)/2 entries on and below the diagonal are useful work,
    so the count is 2 d N(N+1) per head.  (A kernel may compute a few masked entries inside
    diagonal tiles; those are not counted.)
    """
    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("heads", heads),
                        ("batch", batch)):
        _positive_int(name, value)
    n, d = seq_len, head_dim
    per_head = 2.0 * d * n * (n + 1) if causal else 4.0 * d * n * n
    return per_head * heads * batch


def standard_attention_hbm_bytes(
    seq_len: int,
    head_dim: int,
    *,
    heads: int = 1,
    batch: int = 1,
    bytes_per_element: int = 2,
    extra_passes: int = 0,
) -> float:
    """HBM bytes read and written by standard attention (Dao 2022, Algorithm 0).

    ``(4Nd + 4N^2) * bytes_per_element`` per (batch, head); ``extra_passes`` element-wise
    passes over the N x N matrix (scale, mask, dropout run as separate kernels) add 2N^2 each.
    """
    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("heads", heads),
                        ("batch", batch), ("bytes_per_element", bytes_per_element)):
        _positive_int(name, value)
    if extra_passes < 0:
        raise ValueError(f"extra_passes must be >= 0, got {extra_passes}")
    n, d = seq_len, head_dim
    elements = 4 * n * d + (4 + 2 * extra_passes) * n * n
    return float(elements * bytes_per_element * heads * batch)


def flash_block_sizes(sram_bytes: float, head_dim: int, bytes_per_element: int = 2
                      ) -> tuple[int, int]:
    """FlashAttention-1's block sizes ``(block_q, block_kv) = (min(Bc, d), Bc)``.

    Bc = ceil(M / (4d)) with M the SRAM size in elements (Dao 2022, Algorithm 1, line 1).
    ``sram_bytes`` is the on-chip memory one thread block may use: the shared memory of one SM
    (A100: 192 KB of combined L1/shared memory per SM, FlashAttention paper section 2.1).
    """
    _positive_int("head_dim", head_dim)
    _positive_int("bytes_per_element", bytes_per_element)
    m = sram_bytes / bytes_per_element
    if m < 4 * head_dim:
        raise ValueError(
            f"sram_bytes={sram_bytes:g} holds {m:g} elements, fewer than 4*head_dim="
            f"{4 * head_dim}: not even one row of Q, K, V and O fits; give the SRAM of one SM "
            "(e.g. 192e3 for an A100)"
        )
    block_kv = math.ceil(m / (4 * head_dim))
    return min(block_kv, head_dim), block_kv


def _kv_rows_read(seq_len: int, block_q: int, block_kv: int, causal: bool) -> int:
    """Rows of K (and of V) that the query-outer loop reads, summed over query blocks."""
    n_q_blocks = math.ceil(seq_len / block_q)
    if not causal:
        return n_q_blocks * seq_len
    rows = 0
    for i in range(n_q_blocks):
        last_query = min(seq_len, (i + 1) * block_q)  # rows 0 .. last_query-1 are visible
        rows += min(seq_len, math.ceil(last_query / block_kv) * block_kv)
    return rows


def _q_rows_streamed(seq_len: int, block_q: int, block_kv: int, causal: bool) -> int:
    """Rows of Q (and of O) that the kv-outer loop visits, summed over key/value blocks."""
    n_kv_blocks = math.ceil(seq_len / block_kv)
    if not causal:
        return n_kv_blocks * seq_len
    rows = 0
    for j in range(n_kv_blocks):
        first_key = j * block_kv  # query blocks that end before this key are skipped
        first_q_block = first_key // block_q
        rows += seq_len - first_q_block * block_q
    return rows


def tiled_attention_hbm_bytes(
    seq_len: int,
    head_dim: int,
    *,
    sram_bytes: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    heads: int = 1,
    batch: int = 1,
    bytes_per_element: int = 2,
    causal: bool = False,
    loop_order: str = "kv_outer",
) -> float:
    """HBM bytes of tiled (Flash) attention's forward pass.

    Give ``sram_bytes`` (block sizes follow FlashAttention-1's rule, ``flash_block_sizes``) or
    both ``block_q`` and ``block_kv``.

    ``loop_order="kv_outer"`` (FlashAttention-1, Algorithm 1): K and V read once (2Nd); for
    every key/value block, the query blocks it can see are read, and O and the fp32 statistics
    m, l are read and written: per visited query row 3d elements + 4 fp32 numbers.
    ``loop_order="q_outer"`` (FlashAttention-2): Q read and O written once (2Nd), the log-sum-exp
    written once (N fp32); for every query block the visible K, V rows are read.
    A causal mask skips blocks that lie wholly above the diagonal.
    """
    _positive_int("seq_len", seq_len)
    _positive_int("head_dim", head_dim)
    _positive_int("heads", heads)
    _positive_int("batch", batch)
    _positive_int("bytes_per_element", bytes_per_element)
    if loop_order not in LOOP_ORDERS:
        raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {loop_order!r}")
    if block_q is None and block_kv is None:
        if sram_bytes is None:
            raise ValueError("give sram_bytes, or both block_q and block_kv")
        block_q, block_kv = flash_block_sizes(sram_bytes, head_dim, bytes_per_element)
    elif block_q is None or block_kv is None:
        raise ValueError("give both block_q and block_kv (or neither, with sram_bytes)")
    _positive_int("block_q", block_q)
    _positive_int("block_kv", block_kv)
    n, d, e = seq_len, head_dim, bytes_per_element
    if loop_order == "kv_outer":
        q_rows = _q_rows_streamed(n, block_q, block_kv, causal)
        per_head = 2 * n * d * e + q_rows * (3 * d * e + 4 * STATS_BYTES)
    else:
        kv_rows = _kv_rows_read(n, block_q, block_kv, causal)
        per_head = 2 * n * d * e + 2 * kv_rows * d * e + n * STATS_BYTES
    return float(per_head * heads * batch)


@dataclass(frozen=True)
class KernelCost:
    """One kernel on the roofline: its FLOPs, HBM bytes and time on ``gpu``."""

    name: str
    flops: float
    hbm_bytes: float
    time_s: float
    bound: str  # "compute" or "memory"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP per HBM byte."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf


@dataclass(frozen=True)
class AttentionCost:
    """Roofline estimate of one attention forward on one GPU (sum over its kernels)."""

    method: str
    gpu: str
    kernels: tuple[KernelCost, ...]

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def hbm_bytes(self) -> float:
        return sum(k.hbm_bytes for k in self.kernels)

    @property
    def time_s(self) -> float:
        return sum(k.time_s for k in self.kernels)

    @property
    def intensity(self) -> float:
        return self.flops / self.hbm_bytes

    @property
    def achieved_flops(self) -> float:
        """Matmul FLOP/s this estimate reaches (FLOPs / time)."""
        return self.flops / self.time_s

    def __repr__(self) -> str:
        return (
            f"AttentionCost({self.method} on {self.gpu}: {self.flops / 1e9:.3g} GFLOP, "
            f"{self.hbm_bytes / 1e6:.4g} MB HBM, {self.intensity:.3g} FLOP/B, "
            f"{self.time_s * 1e6:.4g} us)"
        )


def _kernel(name: str, flops: float, nbytes: float, device: GPU, dtype: str) -> KernelCost:
    roof = Roofline.of(device, dtype)
    bound = "compute" if flops / roof.peak_flops >= nbytes / roof.bandwidth_Bps else "memory"
    return KernelCost(name, flops, nbytes, roof.op_time(flops, nbytes), bound)


def attention_cost(
    device: GPU | str,
    seq_len: int,
    head_dim: int,
    *,
    method: str = "tiled",
    sram_bytes: float | None = None,
    heads: int = 1,
    batch: int = 1,
    dtype: str = "bf16",
    causal: bool = False,
    loop_order: str = "kv_outer",
) -> AttentionCost:
    """Roofline time of attention's forward on a catalog GPU, per kernel.

    ``method="standard"``: three kernels (QK^T, softmax, PV) with Algorithm 0's traffic; the
    mask of a causal run is taken as fused into the softmax and halves nothing (the N x N
    matrix is still written in full).  ``method="tiled"``: one kernel with
    ``tiled_attention_hbm_bytes`` traffic and FlashAttention-1's block sizes for
    ``sram_bytes``, the SRAM of one SM (A100: 192e3, FlashAttention paper section 2.1; H100:
    256e3, NVIDIA H100 whitepaper).  A standard kernel computes every entry of the N x N matrix,
    masked or not, so its FLOPs are the non-causal count.
    """
    device = gpu(device)
    e = 1 if dtype in ("fp8", "int8") else (4 if dtype in ("fp32", "tf32") else 2)
    hb = heads * batch
    n, d = seq_len, head_dim
    if method == "standard":
        flops = attention_flops(n, d, heads=heads, batch=batch, causal=False)
        kernels = (
            _kernel("QK^T", flops / 2, (2 * n * d + n * n) * e * hb, device, dtype),
            _kernel("softmax", 0.0, 2 * n * n * e * hb, device, dtype),
            _kernel("PV", flops / 2, (n * n + 2 * n * d) * e * hb, device, dtype),
        )
    elif method == "tiled":
        if sram_bytes is None:
            raise ValueError("method='tiled' needs sram_bytes, the SRAM of one SM (A100: 192e3)")
        flops = attention_flops(n, d, heads=heads, batch=batch, causal=causal)
        nbytes = tiled_attention_hbm_bytes(
            n, d, sram_bytes=sram_bytes, heads=heads, batch=batch, bytes_per_element=e,
            causal=causal, loop_order=loop_order,
        )
        kernels = (_kernel("flash", flops, nbytes, device, dtype),)
    else:
        raise ValueError(f"method must be 'standard' or 'tiled', got {method!r}")
    return AttentionCost(method, device.name, kernels)
