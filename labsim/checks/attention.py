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
from collections.abc import Callable
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
                       forbid=FORBID, names=True, torch_only=True)
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
    return _one_block_of_keys(case, out, case.kwargs.get("block_kv", 64))


def _one_block_of_keys(case: Case, out: Outcome, block_kv: int) -> str | None:
    """No created matrix is wider than a block of keys (or the head size): scores over every
    key for a few query rows are a full softmax row, not the online softmax's tile."""
    q, m = case.args[0], case.args[1].shape[-2]
    d = q.shape[-1]
    # tensors shaped like the scores (as many dimensions as Q): per-row vectors such as L,
    # one dimension fewer, may be as long as N
    widest = int((out.observed.get("widest") or {}).get(str(q.dim()), 0))
    limit = max(min(block_kv, m), d)
    if widest > limit:
        return (f"it created a matrix {widest} wide, over a block of {min(block_kv, m)} keys: "
                f"scores against all {m} keys at once are a whole softmax row; fold the keys "
                "in one block at a time with the online softmax (a running max m, sum l and "
                "output, rescaled by exp(m_old - m_new))")
    return None


def _tiled_attention_cases() -> list[Case]:
    specs = [
        ("N=32 divisible by blocks of 8", (32, 8), False, 8, 8, 1, 1.0, None, torch.float64),
        ("N=37 not divisible by blocks of 8 x 16", (37, 8), False, 8, 16, 2, 1.0, None,
         torch.float64),
        ("causal, N=37, blocks 8 x 16", (37, 8), True, 8, 16, 3, 1.0, None, torch.float64),
        ("causal, N=29, blocks 16 x 4 (diagonal crosses tiles)", (2, 29, 4), True, 16, 4, 4,
         1.0, None, torch.float64),
        ("N=5, blocks of 2 (the last block a single row)", (5, 4), True, 2, 2, 5, 1.0, None,
         torch.float64),
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
                       rules=(_no_sdpa, _tiles_only), forbid=FORBID, names=True,
                       torch_only=True)
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


# -- FlashAttention-2 forward and backward as a torch.autograd.Function -----------------------

FA2_TILE = 128  # the largest tile side a learner's kernel may use


def _fa2_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, ...]:
    """(O, dQ, dK, dV) in float64 by autograd through SDPA's math (the oracle)."""
    q, k, v = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    out = _sdpa(q, k, v, causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.double())
    return out.detach(), dq, dk, dv


def logsumexp_rows(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """L = logsumexp over keys of Q K^T / sqrt(d), per query row, in float64: what
    FlashAttention saves for backward (Dao 2023, Algorithm 1)."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def _fa2_case(name: str, shape: tuple[int, ...], *, causal: bool, seed: int,
              n_kv: int | None = None, scale: float = 1.0,
              dtype: torch.dtype = torch.float64) -> Case:
    q, k, v = _qkv(shape, n_kv, seed=seed, scale=scale, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1000)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(dtype)
    tol = close(1e-9, 1e-11) if dtype == torch.float64 else (
        close(2e-3, 2e-4) if dtype == torch.float32 else close(6e-2, 6e-2))
    return Case(name, (q, k, v, do), {"is_causal": causal},
                _fa2_reference(q, k, v, do, causal), tol)


def _saved_recorder(saved: dict[int, int], rows: list[torch.Tensor], row_shape: torch.Size
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook recording each saved storage's bytes, and copies of the saved tensors
    with one value per query row (L's shape)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        if t.shape in (row_shape, row_shape + (1,)):
            rows.append(t.detach().reshape(row_shape).double().clone())
        return t

    return pack


def _drive_fa2(fns: Any, cases: Any, spec: Spec) -> list[Outcome]:
    """Run ``cls.apply(q, k, v, is_causal)`` and its backward with ``dO`` on each case; record
    what its forward saved for backward (bytes, by storage) and the largest tensor created."""
    from labsim.checks._core import plain_outcome
    from labsim.checks._observe import watch

    cls = fns[0]
    outcomes = []
    for case in cases:
        q, k, v, do = (t.detach().clone().requires_grad_(i < 3)
                       for i, t in enumerate(case.args))
        saved: dict[int, int] = {}
        rows: list[torch.Tensor] = []
        pack = _saved_recorder(saved, rows, q.shape[:-1])

        with watch(spec.forbid, ops=spec.ops, functions=spec.names) as seen:
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = cls.apply(q, k, v, case.kwargs.get("is_causal", False))
                out.backward(do)
                value = (out.detach(), q.grad, k.grad, v.grad)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                outcomes.append(Outcome.of_error(exc, seen.summary()))
                continue
        lse = logsumexp_rows(q.detach(), k.detach(), case.kwargs.get("is_causal", False))
        lse_error = min((float((r - lse).abs().max()) for r in rows), default=math.inf)
        observed = {**seen.summary(), "saved_bytes": sum(saved.values()),
                    "lse_error": lse_error}
        outcomes.append(plain_outcome(value, observed))
    return outcomes


def fa2_saved_limit(case: Case) -> int:
    """Bytes a FlashAttention forward may save for backward in ``case``: Q, K, V and O in
    the inputs' dtype, L in fp32 or wider (8 bytes a row), and 1 KB for scalars: O(N d)."""
    q, k = case.args[0], case.args[1]
    lead = math.prod(q.shape[:-2])
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    return lead * ((2 * n * d + 2 * m * d) * q.element_size() + 8 * n) + 1024


def _saves_o_and_l_only(case: Case, out: Outcome) -> str | None:
    got, limit = out.observed.get("saved_bytes", 0), fa2_saved_limit(case)
    if got > limit:
        return (f"its forward saved {got} bytes for backward; FlashAttention saves Q, K, V, O "
                f"and L, {limit} bytes here: no N x N tensor, and no autograd graph of its own "
                "(compute the forward under torch.no_grad or with plain ops in forward())")
    if out.observed.get("lse_error", math.inf) > 1e-3 * max(1.0, abs(case.args[0]).max()):
        return ("no tensor of one value per query row equal to L = logsumexp(Q K^T / sqrt(d)) "
                "was saved with ctx.save_for_backward: save L and recompute P = exp(S - L) "
                "in backward")
    return None


def _backward_by_hand(case: Case, out: Outcome) -> str | None:
    if out.observed.get("graph_tasks", 1) > 1:
        return ("its backward ran autograd again (torch.autograd.grad or .backward inside "
                "backward): compute dQ, dK and dV yourself, from P = exp(S - L) recomputed "
                "tile by tile (Dao 2023, Algorithm 2)")
    return None


def _fa2_tiles_only(case: Case, out: Outcome) -> str | None:
    q, k = case.args[0], case.args[1]
    lead = math.prod(q.shape[:-2])
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    limit = lead * max(n * d, m * d, min(FA2_TILE, n) * min(FA2_TILE, m))
    largest = out.observed.get("largest_new", 0)
    if largest > limit:
        return (f"forward or backward created a tensor of {largest} elements; the limit here "
                f"is {limit} (a tile of at most {FA2_TILE} x {FA2_TILE} scores, or an input's "
                "size): recompute P tile by tile in backward, never the whole N x N matrix")
    return _one_block_of_keys(case, out, FA2_TILE)


def _fa2_cases() -> list[Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    return [
        # every case has more than one tile of 128 rows and keys: a whole N x N matrix, or a
        # row of scores against every key, is never within the tile limit
        _fa2_case("one head, N=150, d=8", (150, 8), causal=False, seed=21),
        _fa2_case("causal, N=170, d=8", (170, 8), causal=True, seed=22),
        _fa2_case("batch 2 x heads 2, causal, N=140, d=16", (2, 2, 140, 16), causal=True,
                  seed=23),
        _fa2_case("cross-attention: 140 queries, 200 keys", (140, 16), n_kv=200, causal=False,
                  seed=24),
        _fa2_case("large scores: the running max must rescale", (2, 133, 8), causal=True,
                  seed=25, scale=20.0),
        _fa2_case("d=64, N=256, causal: no N x N tensor", (256, 64), causal=True, seed=26),
        _fa2_case("d=80, N=200, fp32 inputs", (200, 80), causal=False, seed=27, dtype=f32),
        _fa2_case("d=128, N=256, bf16 inputs (fp32 accumulation)", (256, 128), causal=True,
                  seed=28, dtype=bf16),
    ]


flash_attention2 = Spec("flash_attention2", _fa2_cases, drive=_drive_fa2,
                        rules=(_no_sdpa, _saves_o_and_l_only, _fa2_tiles_only,
                               _backward_by_hand),
                        forbid=FORBID, names=True, torch_only=True)
"""``cls``: a ``torch.autograd.Function`` with ``forward(ctx, q, k, v, is_causal=False) -> O``
(..., Nq, d) that saves L = logsumexp(Q K^T / sqrt d) (one value per query row) with Q, K, V
and O, and ``backward(ctx, dO) -> (dQ, dK, dV, None)`` that recomputes P from L; never SDPA,
never an N x N tensor, at most Q, K, V, O and L saved.  (Stanford CS336 assignment 2's
interface.)"""
