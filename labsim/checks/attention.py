"""Checks for the flash-attention lab: naive attention, tiled online-softmax attention and
the HBM-traffic model of standard attention.

The reference is ``F.scaled_dot_product_attention`` in float64, so "equal" means equal up to
float64 rounding (~1e-15 relative): a tiled attention that is exact passes, one that
approximates does not.  Neither exercise may call SDPA (the recorder sees its kernels even
under ``torch._C.DisableTorchFunction()``), and tiled attention may never create a tensor
larger than one tile of scores, the output or an input (not the N x N matrix, not a row of
N scores per query, not an N x N mask).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from labsim.attention import standard_attention_hbm_bytes
from labsim.checks._core import Case, Outcome, Spec, close

RTOL = 1e-9
ATOL = 1e-12
# SDPA's kernels, and the op only its math path uses (``_safe_softmax``, for fully masked
# rows): seen at the dispatcher whichever backend SDPA picks, under DisableTorchFunction too
SDPA = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
        "_fused_sdp_choice", "_safe_softmax")
FORBID = ("labsim.attention:*",
          "torch.nn.attention:sdpa_kernel", "torch.backends.cuda:sdp_kernel",
          "torch.backends.cuda:enable_flash_sdp", "torch.backends.cuda:enable_math_sdp",
          "torch.backends.cuda:enable_mem_efficient_sdp", "torch.backends.cuda:enable_cudnn_sdp")


def _qkv(shape_q: tuple[int, ...], n_kv: int | None = None, *, seed: int, scale: float = 1.0,
         dtype: torch.dtype = torch.float64
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape_kv = shape_q[:-2] + (n_kv if n_kv is not None else shape_q[-2], shape_q[-1])
    q = torch.randn(shape_q, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(shape_kv, generator=gen, dtype=torch.float64) * scale
    v = torch.randn(shape_kv, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The oracle: SDPA in float64 on the inputs' values."""
    q, k, v = (t.double() for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _attention_case(name: str, shape: tuple[int, ...], *, causal: bool, seed: int,
                    n_kv: int | None = None, scale: float = 1.0,
                    dtype: torch.dtype = torch.float64, **kwargs: Any) -> Case:
    q, k, v = _qkv(shape, n_kv, seed=seed, scale=scale, dtype=dtype)
    compare = close(RTOL, ATOL) if dtype == torch.float64 else close(3e-2, 3e-2)
    return Case(name, (q, k, v), {"causal": causal, **kwargs}, _sdpa(q, k, v, causal), compare)


def _no_sdpa(case: Case, out: Outcome) -> str | None:
    seen = [*out.observed.get("ops", {}), *out.observed.get("functions", [])]
    used = sorted({n for n in seen if any(s in n for s in SDPA)})
    if used:
        return (f"it calls scaled_dot_product_attention ({', '.join(used)[:120]}); write the "
                "attention yourself")
    return None


def _naive_attention_cases() -> list[Case]:
    return [
        _attention_case("one head, N=7, d=4", (7, 4), causal=False, seed=1),
        _attention_case("causal, N=9, d=8", (9, 8), causal=True, seed=2),
        _attention_case("batch 2 x heads 3, N=16, d=8", (2, 3, 16, 8), causal=False, seed=3),
        _attention_case("batch 2 x heads 2, causal, N=13", (2, 2, 13, 4), causal=True, seed=4),
        _attention_case("N=1 (a single query and key)", (1, 5), causal=True, seed=5),
        _attention_case("cross-attention: 5 queries, 11 keys", (5, 8), n_kv=11, causal=False,
                        seed=6),
        _attention_case("large scores (softmax must subtract the max)", (2, 6, 4),
                        causal=False, seed=7, scale=30.0),
        _attention_case("bf16 inputs, odd head size d=7", (2, 12, 7), causal=True, seed=8,
                        dtype=torch.bfloat16),
    ]


naive_attention = Spec("naive_attention", _naive_attention_cases, rules=(_no_sdpa,),
                       forbid=FORBID, names=True)
"""``fn(q, k, v, causal=False)`` must equal SDPA for (..., N, d) inputs, without calling it."""


def tile_limit(case: Case) -> int:
    """The most elements one tensor created by tiled attention may hold for ``case``: one
    (block_q x block_kv) tile of scores, or the size of an input or of the output, per batch
    and head (never an N x M matrix, nor a row of M scores per query)."""
    q, k = case.args[0], case.args[1]
    n, d, m = q.shape[-2], q.shape[-1], k.shape[-2]
    lead = math.prod(q.shape[:-2])
    bq, bkv = case.kwargs.get("block_q", 64), case.kwargs.get("block_kv", 64)
    return lead * max(n * d, m * d, min(bq, n) * min(bkv, m))


def _tiles_only(case: Case, out: Outcome) -> str | None:
    largest, limit = out.observed.get("largest_new", 0), tile_limit(case)
    if largest > limit:
        return (f"it created a tensor of {largest} elements; the limit here is {limit} (one "
                "block_q x block_kv tile, or an input's size): no N x N scores, no full rows "
                "of scores, no N x N mask")
    return None


def _tiled_attention_cases() -> list[Case]:
    specs = [
        ("N=32 divisible by blocks of 8", (32, 8), False, 8, 8, 1, 1.0, None, torch.float64),
        ("N=37 not divisible by blocks of 8 x 16", (37, 8), False, 8, 16, 2, 1.0, None,
         torch.float64),
        ("causal, N=37, blocks 8 x 16", (37, 8), True, 8, 16, 3, 1.0, None, torch.float64),
        ("causal, N=29, blocks 16 x 4 (diagonal crosses tiles)", (2, 29, 4), True, 16, 4, 4,
         1.0, None, torch.float64),
        ("blocks larger than N=5", (5, 4), True, 64, 64, 5, 1.0, None, torch.float64),
        ("block size 1 (one key at a time)", (6, 4), False, 1, 1, 6, 1.0, None, torch.float64),
        ("large scores: the running max must rescale", (3, 20, 8), False, 4, 4, 7, 30.0, None,
         torch.float64),
        ("cross-attention: 37 queries, 53 keys, blocks 8 x 16", (37, 8), False, 8, 16, 10, 1.0,
         53, torch.float64),
        ("odd head size d=5, N=23, blocks 8 x 4", (2, 23, 5), True, 8, 4, 11, 1.0, None,
         torch.float64),
        ("bf16 inputs, N=40, blocks 16 x 8", (40, 8), True, 16, 8, 12, 1.0, None,
         torch.bfloat16),
        ("batch 2 x heads 2, N=192, blocks 64: no N x N tensor", (2, 2, 192, 16), False, 64, 64,
         8, 1.0, None, torch.float64),
        ("causal, N=200, blocks 64 x 32: no N x N tensor (nor mask)", (200, 16), True, 64, 32,
         9, 1.0, None, torch.float64),
    ]
    return [_attention_case(name, shape, causal=causal, seed=seed, scale=scale, n_kv=n_kv,
                            dtype=dtype, block_q=bq, block_kv=bkv)
            for name, shape, causal, bq, bkv, seed, scale, n_kv, dtype in specs]


tiled_attention = Spec("tiled_attention", _tiled_attention_cases,
                       rules=(_no_sdpa, _tiles_only), forbid=FORBID, names=True)
"""``fn(q, k, v, causal=False, block_q=64, block_kv=64)``: exact, never calls SDPA, and never
creates a tensor larger than a tile of scores (or an input's size)."""


def _standard_traffic_cases() -> list[Case]:
    shapes = [(1, 1, 1), (1024, 64, 2), (4096, 128, 2), (2048, 64, 4), (100, 7, 1),
              (16384, 128, 2)]
    return [Case(f"N={n}, d={d}, {e} B/element", (n, d, e), {},
                 standard_attention_hbm_bytes(n, d, bytes_per_element=e))
            for n, d, e in shapes]


standard_traffic = Spec("standard_traffic", _standard_traffic_cases, compare=close(1e-9),
                        forbid=FORBID, ops=False)
"""``fn(seq_len, head_dim, bytes_per_element)``: HBM bytes of Dao 2022 Algorithm 0."""
