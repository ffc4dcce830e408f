"""labsim.checks.attention: correct solutions pass; each typical mistake fails."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labsim.checks import CheckFailed
from labsim.checks import attention as check
from labsim.experiments.attention import per_block_softmax_attention


def naive(q, k, v, causal=False):  # noqa: ANN001, ANN201
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def tiled(q, k, v, causal=False, block_q=64, block_kv=64):  # noqa: ANN001, ANN201
    out = torch.empty_like(q)
    n = q.shape[-2]
    for i in range(0, n, block_q):
        qi = q[..., i:i + block_q, :] / math.sqrt(q.shape[-1])
        m = torch.full(qi.shape[:-1] + (1,), -math.inf, dtype=q.dtype)
        total = torch.zeros_like(m)
        acc = torch.zeros_like(qi)
        for j in range(0, k.shape[-2], block_kv):
            s = qi @ k[..., j:j + block_kv, :].transpose(-1, -2)
            if causal:
                rows = torch.arange(i, i + s.shape[-2]).unsqueeze(-1)
                s = s.masked_fill(torch.arange(j, j + s.shape[-1]) > rows, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            total = alpha * total + p.sum(-1, keepdim=True)
            acc = alpha * acc + p @ v[..., j:j + block_kv, :]
            m = m_new
        out[..., i:i + block_q, :] = acc / total
    return out


def test_correct_solutions_pass(capsys: pytest.CaptureFixture) -> None:
    check.naive_attention(naive)
    check.tiled_attention(tiled)
    check.standard_traffic(lambda n, d, e: float((4 * n * d + 4 * n * n) * e))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["PASS naive_attention: 8/8 cases passed",
                     "PASS tiled_attention: 12/12 cases passed",
                     "PASS standard_traffic: 6/6 cases passed"]


@pytest.mark.parametrize(("fn", "reason"), [
    (lambda q, k, v, causal=False: torch.softmax(q @ k.transpose(-1, -2), -1) @ v, "element"),
    (lambda q, k, v, causal=False: naive(q, k, v, False), "causal"),
])
def test_naive_mistakes_fail(fn, reason: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match="FAIL naive_attention"):
        check.naive_attention(fn)


def test_materialising_the_matrix_fails_even_when_exact() -> None:
    with pytest.raises(CheckFailed, match="N x N"):
        check.tiled_attention(lambda q, k, v, causal=False, block_q=64, block_kv=64:
                              naive(q, k, v, causal))


@pytest.mark.parametrize("name", ["naive_attention", "tiled_attention"])
def test_calling_sdpa_is_not_writing_attention(name: str) -> None:
    def sdpa(q, k, v, causal=False, **_):  # noqa: ANN001, ANN202
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with pytest.raises(CheckFailed, match="write the attention yourself"):
        getattr(check, name)(sdpa)


def test_tiling_without_rescaling_fails() -> None:
    with pytest.raises(CheckFailed, match="0/12"):
        check.tiled_attention(lambda q, k, v, causal=False, block_q=64, block_kv=64:
                              per_block_softmax_attention(q, k, v, block_kv))


def test_traffic_without_the_matrix_round_trips_fails() -> None:
    with pytest.raises(CheckFailed, match="standard_traffic"):
        check.standard_traffic(lambda n, d, e: float((4 * n * d + n * n) * e))
