"""Checks for the flash-attention lab: naive attention, tiled online-softmax attention and
the HBM-traffic model of standard attention.

The reference is ``F.scaled_dot_product_attention`` in float64, so "equal" means equal up to
float64 rounding (~1e-15 relative): a tiled attention that is exact passes, one that
approximates does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labsim.attention import standard_attention_hbm_bytes
from labsim.checks._core import Case, close, run_check
from labsim.lab.profile import torch_calls

RTOL = 1e-9
ATOL = 1e-12


def _qkv(shape_q: tuple[int, ...], n_kv: int | None = None, *, seed: int, scale: float = 1.0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape_kv = shape_q[:-2] + (n_kv if n_kv is not None else shape_q[-2], shape_q[-1])
    q = torch.randn(shape_q, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(shape_kv, generator=gen, dtype=torch.float64) * scale
    v = torch.randn(shape_kv, generator=gen, dtype=torch.float64)
    return q, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _attention_case(name: str, shape: tuple[int, ...], *, causal: bool, seed: int,
                    n_kv: int | None = None, scale: float = 1.0, **kwargs: Any) -> Case:
    q, k, v = _qkv(shape, n_kv, seed=seed, scale=scale)
    return Case(name, (q, k, v), {"causal": causal, **kwargs}, _sdpa(q, k, v, causal))


def naive_attention(fn: Callable[..., torch.Tensor]) -> None:
    """``fn(q, k, v, causal=False)`` must equal SDPA for (..., N, d) inputs, in float64."""
    cases = [
        _attention_case("one head, N=7, d=4", (7, 4), causal=False, seed=1),
        _attention_case("causal, N=9, d=8", (9, 8), causal=True, seed=2),
        _attention_case("batch 2 x heads 3, N=16, d=8", (2, 3, 16, 8), causal=False, seed=3),
        _attention_case("batch 2 x heads 2, causal, N=13", (2, 2, 13, 4), causal=True, seed=4),
        _attention_case("N=1 (a single query and key)", (1, 5), causal=True, seed=5),
        _attention_case("cross-attention: 5 queries, 11 keys", (5, 8), n_kv=11, causal=False,
                        seed=6),
        _attention_case("large scores (softmax must subtract the max)", (2, 6, 4),
                        causal=False, seed=7, scale=30.0),
    ]
    base = close(RTOL, ATOL)
    run_check("naive_attention", _no_sdpa(fn), cases,
              compare=lambda got, expected: base(got.result, expected))


FORBIDDEN = "scaled_dot_product_attention"


def _no_sdpa(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` and fail the case if it called SDPA (the exercise is to write attention)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls = torch_calls(fn, *args, **kwargs)
        if FORBIDDEN in calls.names:
            raise ValueError(
                "it calls F.scaled_dot_product_attention; write the attention yourself"
            )
        return calls

    return wrapped


def _tiled_compare(limit: int | None) -> Callable[[Any, Any], str | None]:
    base = close(RTOL, ATOL)

    def compare(got: Any, expected: Any) -> str | None:
        out, largest = got.result, got.largest
        reason = base(out, expected)
        if reason:
            return reason
        if limit is not None and largest >= limit:
            return (
                f"a tensor of {largest} elements was built; the N x N score matrix has "
                f"{limit}: work on (block_q x block_kv) tiles only (this includes the mask)"
            )
        return None

    return compare


def tiled_attention(fn: Callable[..., torch.Tensor]) -> None:
    """``fn(q, k, v, causal=False, block_q=64, block_kv=64)``: exact and never N x N.

    Every case checks the result against SDPA (float64); the last two also record the size
    of every tensor the function creates and fail if one is as large as the N x N matrix.
    """
    specs = [
        ("N=32 divisible by blocks of 8", (32, 8), False, 8, 8, 1, 1.0, False),
        ("N=37 not divisible by blocks of 8 x 16", (37, 8), False, 8, 16, 2, 1.0, False),
        ("causal, N=37, blocks 8 x 16", (37, 8), True, 8, 16, 3, 1.0, False),
        ("causal, N=29, blocks 16 x 4 (diagonal crosses tiles)", (2, 29, 4), True, 16, 4, 4,
         1.0, False),
        ("blocks larger than N=5", (5, 4), True, 64, 64, 5, 1.0, False),
        ("block size 1 (one key at a time)", (6, 4), False, 1, 1, 6, 1.0, False),
        ("large scores: the running max must rescale", (3, 20, 8), False, 4, 4, 7, 30.0,
         False),
        ("batch 2 x heads 2, N=192, blocks 64: no N x N tensor", (2, 2, 192, 16), False, 64, 64,
         8, 1.0, True),
        ("causal, N=200, blocks 64 x 32: no N x N tensor (nor mask)", (200, 16), True, 64, 32,
         9, 1.0, True),
    ]
    cases = []
    for name, shape, causal, bq, bkv, seed, scale, watch in specs:
        case = _attention_case(name, shape, causal=causal, seed=seed, scale=scale, block_q=bq,
                               block_kv=bkv)
        n = shape[-2]
        cases.append(Case(case.name, case.args, case.kwargs, case.expected,
                          _tiled_compare(n * n if watch else None)))

    run_check("tiled_attention", _no_sdpa(fn), cases)


def standard_traffic(fn: Callable[..., float]) -> None:
    """``fn(seq_len, head_dim, bytes_per_element)``: HBM bytes of Dao 2022 Algorithm 0."""
    shapes = [(1, 1, 1), (1024, 64, 2), (4096, 128, 2), (2048, 64, 4), (100, 7, 1),
              (16384, 128, 2)]
    cases = [
        Case(f"N={n}, d={d}, {e} B/element", (n, d, e), {},
             standard_attention_hbm_bytes(n, d, bytes_per_element=e))
        for n, d, e in shapes
    ]
    run_check("standard_traffic", fn, cases, compare=close(1e-9))
