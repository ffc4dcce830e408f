"""labsim.lab.autocast: op dtypes under autocast, activation bytes by precision mode."""

from __future__ import annotations

import pytest

from labsim import Transformer
from labsim.lab import GPT, random_batch
from labsim.lab import autocast as A


def test_matmuls_go_low_losses_stay_fp32():
    got = A.autocast_dtypes("bf16")
    assert got["linear"] == got["matmul"] == "bfloat16"
    assert got["mse_loss"] == got["cross_entropy"] == "float32"
    assert A.autocast_dtypes("fp16")["linear"] == "float16"


def test_pure_bf16_halves_activations_autocast_saves_less():
    cfg = Transformer(layers=1, hidden=32, heads=2, seq_len=16, vocab=64)
    model = GPT(cfg)
    idx, _ = random_batch(cfg, batch=2)
    got = {mode: A.gpt_activation_bytes(model, idx, mode) for mode in A.PRECISION_MODES}
    index_bytes = idx.numel() * 8  # the embedding keeps the int64 token ids in every mode
    assert got["pure-bf16"] - index_bytes == pytest.approx((got["fp32"] - index_bytes) / 2,
                                                           rel=0.02)
    assert got["pure-bf16"] < got["autocast-bf16"] <= got["fp32"]
    with pytest.raises(ValueError):
        A.gpt_activation_bytes(model, idx, "fp8")


def test_matmul_rate_is_positive():
    assert A.matmul_flops_per_s(32, "fp32", max_seconds=0.5) > 0
