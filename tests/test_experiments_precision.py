"""labsim.experiments.precision: format limits, fp16 underflow, the AMP training loop.

labsim.experiments.precision: op dtypes under autocast, activation bytes by precision mode.
"""

from __future__ import annotations

import math

import pytest
import torch

from labsim import Transformer
from labsim.experiments.precision import (
    AUTOCAST_LISTS,
    PRECISION_MODES,
    accumulate,
    autocast_dtypes,
    autocast_lists,
    format_limits,
    fp16_gradient_underflow,
    gpt_activation_bytes,
    gpt_saved_bytes,
    grad_scaler,
    matmul_flops_per_s,
    round_trip,
    train_amp,
)
from labsim.lab import GPT, random_batch
from labsim.lab.device import torch_dtype


def test_fp16_limits_are_the_ieee_half_values():
    lim = format_limits("fp16")
    assert (lim.exponent_bits, lim.mantissa_bits, lim.bits) == (5, 10, 16)
    assert lim.max == 65504.0
    assert lim.smallest_normal == 2.0**-14
    assert lim.smallest_subnormal == 2.0**-24  # 5.96e-8
    assert lim.eps == 2.0**-10


def test_bf16_has_fp32_range_and_8_bit_precision():
    bf16, fp32 = format_limits("bf16"), format_limits("fp32")
    assert bf16.smallest_normal == fp32.smallest_normal
    assert bf16.max == pytest.approx(fp32.max, rel=1e-2)
    assert (bf16.exponent_bits, bf16.mantissa_bits, bf16.eps) == (8, 7, 2.0**-7)


def test_round_trip_flushes_underflow_and_overflows_to_inf():
    got = round_trip([1e-8, 7e-8, 7e4, 1.0], "fp16").tolist()
    assert got[0] == 0.0
    assert got[1] == 2.0**-24
    assert math.isinf(got[2])
    assert got[3] == 1.0
    assert round_trip([7e4], "bf16").item() == pytest.approx(7e4, rel=2**-8)


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="fp16"):
        torch_dtype("fp12")


def test_small_gradients_vanish_in_fp16_and_survive_with_loss_scaling():
    plain = fp16_gradient_underflow(1.0, residual=1e-5)
    assert plain.output_grad_abs_median < 2.0**-24
    assert plain.zero_fraction == 1.0 and plain.rel_error == pytest.approx(1.0)
    scaled = fp16_gradient_underflow(2.0**16, residual=1e-5)
    assert scaled.zero_fraction == 0.0
    assert scaled.rel_error < 2e-3  # a few fp16 rounding steps, no flush


def test_loss_scale_must_be_positive():
    with pytest.raises(ValueError):
        fp16_gradient_underflow(0.0)


def test_train_amp_with_grad_scaler_follows_the_dynamic_rule():
    interval = 4
    run = train_amp(grad_scaler(init_scale=2.0**16, growth_interval=interval), steps=16)
    assert run.skipped_steps, "the model is built so that some fp16 steps overflow"
    assert not all(run.skipped)
    good = 0
    scales = [*run.scales, run.final_scale]
    for i, skipped in enumerate(run.skipped):
        assert skipped == (not math.isfinite(run.grad_norms[i]))
        if skipped:
            assert scales[i + 1] == scales[i] / 2
            good = 0
        else:
            good += 1
            grow = good == interval
            assert scales[i + 1] == scales[i] * (2 if grow else 1)
            good = 0 if grow else good


def test_train_amp_never_skips_in_bf16_and_is_deterministic():
    a = train_amp(grad_scaler(init_scale=2.0**16, growth_interval=4), steps=6, dtype="bf16")
    b = train_amp(grad_scaler(init_scale=2.0**16, growth_interval=4), steps=6, dtype="bf16")
    assert a.skipped_steps == ()
    assert all(torch.equal(x, y) for x, y in zip(a.weights, b.weights))
    assert a.losses == b.losses


def test_matmuls_go_low_losses_stay_fp32():
    got = autocast_dtypes("bf16")
    assert got["linear"] == got["matmul"] == "bfloat16"
    assert got["mse_loss"] == got["cross_entropy"] == "float32"
    assert autocast_dtypes("fp16")["linear"] == "float16"


def test_cpu_autocast_leaves_softmax_and_layer_norm_alone():
    got = autocast_lists("bf16", "cpu")
    assert got["linear"] == got["matmul"] == AUTOCAST_LISTS[0]
    assert got["mse_loss"] == got["cross_entropy"] == AUTOCAST_LISTS[1]
    assert got["softmax"] == got["layer_norm"] == got["relu"] == AUTOCAST_LISTS[2]


def test_autocast_keeps_a_low_precision_copy_of_every_linear_weight():
    cfg = Transformer(layers=1, hidden=32, heads=2, seq_len=16, vocab=64)
    model = GPT(cfg)
    idx, _ = random_batch(cfg, batch=2)
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    _, copies = gpt_saved_bytes(model, idx, "autocast-bf16")
    # qkv, proj, up, down and the output layer (tied to the word embedding), 2 B each
    assert copies == 2 * sum(w.numel() for w in weights.values())
    assert gpt_saved_bytes(model, idx, "fp32")[1] == 0


def test_pure_bf16_halves_activations_autocast_saves_less():
    cfg = Transformer(layers=1, hidden=32, heads=2, seq_len=16, vocab=64)
    model = GPT(cfg)
    idx, _ = random_batch(cfg, batch=2)
    got = {mode: gpt_activation_bytes(model, idx, mode) for mode in PRECISION_MODES}
    index_bytes = idx.numel() * 8  # the embedding keeps the int64 token ids in every mode
    assert got["pure-bf16"] - index_bytes == pytest.approx((got["fp32"] - index_bytes) / 2,
                                                           rel=0.02)
    assert got["pure-bf16"] < got["autocast-bf16"] <= got["fp32"]
    with pytest.raises(ValueError):
        gpt_activation_bytes(model, idx, "fp8")


def test_matmul_rate_is_positive():
    assert matmul_flops_per_s(32, "fp32", max_seconds=0.5) > 0


def test_sixteen_bit_sums_stall():
    assert accumulate(0.01, 1000, "fp32") == pytest.approx(10.0, rel=1e-4)
    assert accumulate(0.01, 1000, "bf16") == 4.0  # spacing 2**-5 at 4: half of it > 0.01
    assert 9.0 < accumulate(0.01, 1000, "fp16") < 10.0
