"""Compute cost model: efficiency curve, roofline bounds, layer costs, constants with sources."""

import pytest

from labsim import compute
from labsim.hardware import gpu
from labsim.workload import Transformer

A100 = gpu("A100-80GB")
H100 = gpu("H100-SXM")
GPT = Transformer(layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50304)


def test_gemm_efficiency_grows_with_size_up_to_the_plateau():
    eff = compute.efficiency(A100)
    sizes = [1e6, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13]
    values = [eff.gemm(f) for f in sizes]
    assert values == sorted(values)
    assert values[-1] == pytest.approx(eff.gemm_plateau) and eff.gemm(1e14) == values[-1]
    assert 0 < values[0] < values[-1] <= 1


def test_gemm_time_is_bounded_by_both_roofs():
    for m, n, k in [(8192, 8192, 8192), (16, 8192, 8192), (4096, 4096, 64)]:
        t = compute.gemm_time(m, n, k, A100)
        flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
        assert t >= flops / A100.peak("bf16")
        assert t >= nbytes / A100.memory_bandwidth_Bps
    # a large square GEMM runs at the plateau times the sustained fraction
    eff = compute.efficiency(A100)
    t = compute.gemm_time(16384, 16384, 16384, A100)
    assert 2 * 16384**3 / t == pytest.approx(312e12 * eff.gemm_plateau * eff.sustained)
    # skinny GEMM (matrix-vector like) is memory bound
    t = compute.gemm_time(1, 8192, 8192, A100)
    assert t == pytest.approx(compute.memory_time(2 * (8192 + 8192 * 8192 + 8192), A100))


def test_fp32_uses_tf32_tensor_cores_and_is_slower():
    assert compute.gemm_time(4096, 4096, 4096, A100, "tf32") == pytest.approx(
        2 * compute.gemm_time(4096, 4096, 4096, A100, "bf16"), rel=1e-9)


def test_layer_cost_structure():
    lc = compute.layer_cost(GPT, 4, A100, attention="flash")
    # backward runs two GEMMs per forward GEMM: about twice the forward
    assert 1.8 < lc.backward.time_s / lc.forward.time_s < 2.6
    assert lc.backward.flops == pytest.approx(2 * lc.forward.flops)
    assert lc.recompute.time_s == 0 and lc.model_flops == lc.forward.flops + lc.backward.flops
    full = compute.layer_cost(GPT, 4, A100, recompute="full")
    assert full.recompute == full.forward
    # forward FLOPs: 24 b s h^2 (GEMMs) + 4 b s^2 h (attention), Narayanan et al. 2021
    b, s, h = 4, 2048, 2048
    assert lc.forward.flops == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    assert lc.tp_bytes == b * s * h * 2


def test_tensor_parallel_splits_the_work():
    one = compute.layer_cost(GPT, 4, A100)
    four = compute.layer_cost(GPT, 4, A100, tp=4)
    assert four.forward.flops == pytest.approx(one.forward.flops / 4)
    assert one.forward.time_s / 4 < four.forward.time_s < one.forward.time_s
    sp = compute.layer_cost(GPT, 4, A100, tp=4, sequence_parallel=True)
    assert sp.forward.time_s < four.forward.time_s  # norms and dropout sharded too


def test_selective_recompute_and_standard_attention():
    std = compute.layer_cost(GPT, 4, A100, attention="standard", recompute="selective")
    flash = compute.layer_cost(GPT, 4, A100, attention="flash", recompute="selective")
    assert 0 < std.recompute.time_s < std.forward.time_s / 2
    assert flash.recompute.time_s == 0  # FlashAttention recomputes inside its backward
    assert flash.forward.time_s < std.forward.time_s  # no s x s tensor through HBM


def test_h100_is_faster_and_constants_have_sources():
    assert compute.layer_cost(GPT, 4, H100).forward.time_s < compute.layer_cost(
        GPT, 4, A100).forward.time_s
    for eff in compute.EFFICIENCY.values():
        assert eff.source and 0 < eff.sustained <= 1 and 0 < eff.gemm_plateau <= 1
    assert compute.efficiency(gpu("RTX-4090")).source.startswith("no published")


def test_memory_time_and_optimizer():
    assert compute.memory_time(0, A100) == 0
    big = compute.memory_time(1e9, A100)
    assert big > 1e9 / A100.memory_bandwidth_Bps
    assert compute.optimizer_time(1e9, A100) == pytest.approx(compute.memory_time(30e9, A100))
    assert compute.optimizer_time(1e9, A100, "sgd") < compute.optimizer_time(1e9, A100)


def test_logits_cost():
    f, b = compute.logits_cost(GPT, 2, A100, tp=2)
    assert f.flops == pytest.approx(2 * 2 * 2048 * 2048 * 50304 / 2)
    assert b.flops == pytest.approx(2 * f.flops)


def test_kind_seconds_recut_the_same_step() -> None:
    """By kind, the step's compute is the layers' passes, the head and the optimizer; the
    attention core is what FlashAttention shortens, and nothing else moves."""
    from labsim.compute import KINDS, kind_seconds, layer_cost, logits_cost, optimizer_time

    model = Transformer.preset("gpt2-124m")
    g = gpu("A100-80GB")
    for attention in ("standard", "flash"):
        kinds = kind_seconds(model, 4, g, attention=attention, precision="bf16")
        assert set(kinds) == set(KINDS) and all(v > 0 for v in kinds.values())
        layer = layer_cost(model, 4, g, attention=attention, precision="bf16")
        head_f, head_b = logits_cost(model, 4, g, precision="bf16")
        total = (model.layers * (layer.forward.time_s + layer.backward.time_s)
                 + head_f.time_s + head_b.time_s + optimizer_time(model.params, g))
        assert sum(kinds.values()) == pytest.approx(total, rel=1e-12)
    std = kind_seconds(model, 4, g, attention="standard", precision="bf16")
    fa = kind_seconds(model, 4, g, attention="flash", precision="bf16")
    assert fa["attention"] < std["attention"] / 2
    assert {k: fa[k] for k in KINDS if k != "attention"} == pytest.approx(
        {k: std[k] for k in KINDS if k != "attention"})


def test_softmax_seconds_is_part_of_standard_attention() -> None:
    from labsim.compute import kind_seconds, softmax_seconds

    long = Transformer(layers=4, hidden=512, heads=8, seq_len=8192, vocab=1000)
    g = gpu("H100-SXM")
    soft = softmax_seconds(long, 1, g)
    core = kind_seconds(long, 1, g, attention="standard", precision="bf16")["attention"]
    assert 0.5 * core < soft < core  # at 8192 tokens the scores' traffic dominates the core
