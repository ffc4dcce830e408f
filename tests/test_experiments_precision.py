"""labsim.experiments.precision: format limits, fp16 underflow, the AMP training loop.

labsim.experiments.precision: op dtypes under autocast, activation bytes by precision mode.

labsim.experiments.precision: limits probed on tensors, 16-bit weights updated three ways,
dtypes timed in interleaved rounds.
"""

from __future__ import annotations

import math

import pytest
import torch

from labsim import Transformer
from labsim.experiments.precision import (
    AUTOCAST_LISTS,
    PRECISION_MODES,
    MasterWeight,
    PlainWeight,
    accumulate,
    autocast_dtypes,
    autocast_lists,
    compare_matmul_dtypes,
    compare_training_steps,
    format_limits,
    fp16_gradient_underflow,
    gpt_activation_bytes,
    gpt_saved_bytes,
    grad_scaler,
    low_precision_sgd,
    matmul_flops_per_s,
    probe_limits,
    round_trip,
    state_bytes,
    train_amp,
    update_drift,
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


def test_probes_hold_at_the_true_limits_and_fail_at_wrong_ones():
    lim = format_limits("bf16")
    true = {"max": lim.max, "smallest_normal": lim.smallest_normal,
            "smallest_subnormal": lim.smallest_subnormal, "eps": lim.eps}
    assert all(p.holds for p in probe_limits(true, "bf16"))
    assert len(probe_limits(true, "bf16")) == 7
    fp16_eps_for_bf16 = {**true, "eps": 2.0**-10}  # fp16's precision claimed for bf16
    wrong = {p.label: p.holds for p in probe_limits(fp16_eps_for_bf16, "bf16")}
    assert not wrong["1 + eps"] and wrong["largest finite"]
    assert "NOT the predicted" in repr(probe_limits(fp16_eps_for_bf16, "bf16")[5])


class _Kahan:
    def __init__(self, weight):
        self.weight, self.lost = weight.clone(), torch.zeros_like(weight)

    def add_(self, update):
        owed = update + self.lost
        new = self.weight + owed
        self.lost, self.weight = owed - (new - self.weight), new


def test_plain_16_bit_weights_lose_small_updates_a_master_and_compensation_keep_them():
    plain_sum, plain_weight = update_drift(PlainWeight)
    assert plain_sum.plain == 4.0 and plain_weight.plain == 1.0  # the updates rounded away
    for row in update_drift(_Kahan):
        spacing = 2.0 ** (math.floor(math.log2(abs(row.exact))) - 7)  # bf16 ulp there
        assert abs(row.yours - row.exact) <= spacing / 2
        assert row.yours == row.master  # both round the exact value to the nearest bf16


def test_sgd_in_plain_bf16_stalls_compensation_matches_the_fp32_master():
    plain, master, yours = low_precision_sgd(_Kahan, steps=300)
    assert (plain.bytes_per_param, master.bytes_per_param, yours.bytes_per_param) == (2, 6, 4)
    assert plain.test_mse > 5 * master.test_mse
    assert yours.test_mse == pytest.approx(master.test_mse, rel=0.05)


def test_state_bytes_counts_each_storage_once():
    w = torch.zeros(10, dtype=torch.bfloat16)
    master = MasterWeight(w)
    assert state_bytes(master) == 10 * 4 + 10 * 2

    class Shared:
        def __init__(self):
            self.a = w
            self.b = [w[:5], {"c": w}]

    assert state_bytes(Shared()) == 20


def test_dtype_comparisons_name_both_dtypes_and_a_verdict():
    got = compare_matmul_dtypes(32, ("fp32", "fp64"), rounds=3)
    assert set(got.flops_per_s) == {"fp32", "fp64"} and all(r > 0 for r in got.flops_per_s.values())
    assert {got.comparison.fast, got.comparison.slow} == {"fp32", "fp64"}
    assert got.comparison.rounds == 3 and "32x32 matmul" in repr(got)
    cfg = Transformer(layers=1, hidden=32, heads=2, seq_len=16, vocab=64)
    idx, targets = random_batch(cfg, batch=2)
    steps = compare_training_steps(GPT(cfg), idx, targets, "bf16", rounds=2)
    assert {steps.fast, steps.slow} == {"fp32", "bf16 autocast"} and steps.rounds == 2
