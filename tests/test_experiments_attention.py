"""labsim.experiments.attention: which SDPA kernel ran; the rescaling-free tiling is wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labsim.experiments.attention import SDPA_OPS, per_block_softmax_attention, sdpa_backend


def test_sdpa_backend_names_a_known_kernel() -> None:
    x = torch.randn(1, 2, 64, 16)
    choice = sdpa_backend(x, x, x, causal=True)
    assert choice.backend in SDPA_OPS.values()
    assert choice.aten_op in SDPA_OPS
    assert "cpu" in repr(choice)


def test_sdpa_backend_sees_the_math_fallback_when_forced() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(1, 1, 32, 8)
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_backend(x, x, x).backend == "math"


def test_per_block_softmax_is_exact_only_with_one_block() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)
    one_block = per_block_softmax_attention(q, k, v, block=40)
    assert torch.allclose(one_block, exact, atol=1e-12)
    four_blocks = per_block_softmax_attention(q, k, v, block=10)
    assert (four_blocks - exact).abs().max() > 0.1


def test_flash_and_standard_attention_train_alike() -> None:
    from labsim.experiments.attention import flash_loss_curves

    curves = flash_loss_curves(steps=12)
    assert curves["flash"][-1] < curves["flash"][0] - 0.5  # it learns
    assert max(abs(a - b) for a, b in zip(curves["flash"], curves["standard"])) < 1e-3


# -- the FlashAttention-2 forward in Triton, run by Triton's interpreter on CPU tensors --------

def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    import math

    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # key j visible to query i when j <= i, as SDPA's is_causal
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def _triton_or_skip() -> None:
    from labsim.experiments.attention import triton_available

    reason = triton_available()
    if reason is not None:
        pytest.skip(reason)



@pytest.mark.slow
@pytest.mark.parametrize(("shape_q", "n_k", "causal", "blocks"), [
    ((1, 2, 40, 16), 40, False, (16, 16)),
    ((1, 2, 40, 16), 40, True, (16, 16)),
    ((2, 1, 70, 32), 33, True, (16, 32)),   # Nq > Nk, a partial last block of each
    ((1, 1, 33, 80), 70, True, (32, 16)),   # Nq < Nk, d not a power of two
    ((3, 50, 64), 20, False, (16, 16)),     # (batch, N, d), no head dimension
    ((1, 1, 17, 128), 17, True, (16, 16)),
], ids=["d16", "d16-causal", "nq>nk-causal", "d80-nq<nk-causal", "3d-d64", "d128-causal"])
def test_the_triton_forward_matches_naive_attention(shape_q: tuple[int, ...], n_k: int,
                                                    causal: bool, blocks: tuple[int, int]
                                                    ) -> None:
    _triton_or_skip()
    from labsim.experiments.attention import triton_flash_forward

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(*shape_q, generator=gen)
    k, v = (torch.randn(*shape_q[:-2], n_k, shape_q[-1], generator=gen) for _ in range(2))
    out, lse = triton_flash_forward()(q, k, v, causal, block_m=blocks[0], block_n=blocks[1])
    expected_out, expected_lse = _naive(q, k, v, causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_triton_forward_takes_bf16_and_leaves_the_interpreter_setting_alone() -> None:
    _triton_or_skip()
    import os

    import triton

    from labsim.experiments.attention import triton_flash_forward

    before = (triton.knobs.runtime.interpret, os.environ.get("TRITON_INTERPRET"))
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 32, generator=gen).bfloat16() for _ in range(3))
    out, lse = triton_flash_forward()(q, k, v, True, block_m=16, block_n=16)
    expected_out, expected_lse = _naive(q, k, v, True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)
    assert (triton.knobs.runtime.interpret, os.environ.get("TRITON_INTERPRET")) == before


def test_the_triton_forward_refuses_mismatched_inputs() -> None:
    _triton_or_skip()
    from labsim.experiments.attention import triton_flash_forward

    q, k = torch.randn(1, 8, 16), torch.randn(1, 8, 32)
    with pytest.raises(ValueError, match="share"):
        triton_flash_forward()(q, k, k)


@pytest.mark.slow
def test_the_attention_experiments_import_without_triton() -> None:
    """Triton is optional: importing the module (as lab 04 does) must not import it."""
    import subprocess
    import sys

    code = ("import sys, labsim.experiments.attention; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_triton_without_knobs_is_named_not_crashed_on(monkeypatch) -> None:
    """Triton 3.3.1 has no ``triton.knobs``, which the kernel's launcher sets: lab 04's cell
    must print why it skips, not raise AttributeError."""
    import sys
    import types

    from labsim.experiments.attention import triton_available

    old = types.ModuleType("triton")
    old.__version__ = "3.3.1"
    monkeypatch.setitem(sys.modules, "triton", old)
    reason = triton_available()
    assert reason is not None and "3.3.1" in reason and "triton>=3.4" in reason
