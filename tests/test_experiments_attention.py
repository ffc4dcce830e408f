"""labsim.experiments.attention: which SDPA kernel ran; the rescaling-free tiling is wrong."""

from __future__ import annotations

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
