"""The FlashAttention-2 forward pass as a Triton kernel (imported only when triton is).

Dao 2023 ("FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning"), Algorithm 1: one program per block of ``BLOCK_M`` query rows (and per batch x
head), looping over blocks of ``BLOCK_N`` keys and values with the online softmax: a running
row maximum ``m``, a running row sum ``l`` of ``exp(s - m)`` and an unnormalised output
``acc``, each rescaled by ``exp(m_old - m_new)`` when the maximum grows; the output is divided
by ``l`` once, at the end, and the log-sum-exp ``L = m + log(l)`` is written for the backward
pass.  The layout follows Triton's fused-attention tutorial (``06-fused-attention.py``);
causal attention skips the key blocks wholly above the diagonal and masks the one it crosses.
Causal means key j is visible to query i when j <= i (the top-left aligned mask of
``F.scaled_dot_product_attention(is_causal=True)``, also when Nq != Nk).

``_fa2_forward`` is a plain function here; ``labsim.experiments.attention.triton_flash_forward``
decorates it with ``triton.jit`` under the interpreter setting it is asked for, because
``triton.jit`` reads ``triton.knobs.runtime.interpret`` (the ``TRITON_INTERPRET`` variable)
when it decorates, not when the kernel runs.  For the same reason the kernel calls only
Triton's builtins: the standard library's ``@triton.jit`` helpers (``tl.zeros``, ``tl.max``,
``tl.sum``) were decorated when ``triton`` was imported, for the compiler, and the interpreter
cannot run them; reductions are ``tl.reduce`` with the standard combine functions, which both
the compiler and the interpreter (``ReduceOps``, a numpy fast path) accept.
"""

from __future__ import annotations

import triton.language as tl

_MAX = tl.standard._elementwise_max  # combine functions of tl.max and tl.sum
_SUM = tl.standard._sum_combine


def _fa2_forward(q_ptr, k_ptr, v_ptr, o_ptr, l_ptr,  # noqa: ANN001, ANN202, PLR0913
                 n_q, n_k, d, scale,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,  # noqa: N803
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
                 PRECISION: tl.constexpr):  # noqa: N803
    start_m = tl.program_id(0)
    head = tl.program_id(1)  # batch x head, each (N, d) contiguous
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + head * n_q * d + offs_m[:, None] * d + offs_d[None, :]
    q = tl.load(q_rows, mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < d), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    hi = n_k
    if CAUSAL:
        hi = tl.minimum(n_k, (start_m + 1) * BLOCK_M)  # key blocks above the diagonal: none
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < n_k) & (offs_d[None, :] < d)
        kv_rows = head * n_k * d + cols[:, None] * d + offs_d[None, :]
        k = tl.load(k_ptr + kv_rows, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_rows, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        visible = cols[None, :] < n_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))  # finite: key 0 is visible to every row
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    o_rows = o_ptr + head * n_q * d + offs_m[:, None] * d + offs_d[None, :]
    tl.store(o_rows, o.to(o_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < d))
    tl.store(l_ptr + head * n_q + offs_m, m_i + tl.log(l_i), mask=offs_m < n_q)
