"""FP8 training (labsim.fp8): the linear layers' GEMMs at the FP8 peak, their casts, the rest in
16 bit; refused where a GPU has no FP8 tensor cores."""

from __future__ import annotations

from dataclasses import replace

import pytest

import labsim
from labsim import compute
from labsim.fp8 import FP8_RECIPES, TRANSPOSE_BYTES, cast_bytes, fused_input_bytes, gemm_slowdown
from labsim.published import runs

LLAMA = labsim.Transformer.preset("llama2-7b")
H100 = labsim.gpu("H100-SXM")


def test_fp8_runs_the_linear_gemms_at_the_fp8_peak_and_adds_their_casts() -> None:
    bf16 = compute.layer_cost(LLAMA, 2, H100, precision="bf16")
    fp8 = compute.layer_cost(LLAMA, 2, H100, precision="bf16", fp8="delayed")
    linears = [g for g in LLAMA.layer_gemms(2) if g.name in ("qkv", "attn_out") or
               g.name.startswith("mlp_")]
    assert len(linears) == 4
    # forward: each linear GEMM at the FP8 peak with one-byte operands, plus its input's cast
    # (the attention projection) or transpose (the inputs a fused norm or activation wrote)
    expected = bf16.forward.time_s
    for g in linears:
        cast = cast_bytes("delayed", 2) if g.name == "attn_out" else TRANSPOSE_BYTES
        expected += (compute.gemm_time(g.m, g.n, g.k, H100, "fp8", bytes_per_element=1)
                     - compute.gemm_time(g.m, g.n, g.k, H100, "bf16")
                     + compute.memory_time(g.m * g.k * cast, H100))
        # the FP8 peak is twice bf16's, at the same fraction of it
        assert compute.gemm_time(g.m, g.n, g.k, H100, "fp8", bytes_per_element=1) == \
            pytest.approx(compute.gemm_time(g.m, g.n, g.k, H100, "bf16") / 2, rel=0.05)
    assert fp8.forward.time_s == pytest.approx(expected, rel=1e-12)
    assert fp8.forward.flops == bf16.forward.flops and fp8.backward.flops == bf16.backward.flops
    assert 0.5 < fp8.backward.time_s / bf16.backward.time_s < 0.8
    assert cast_bytes("delayed", 2) == 4 and cast_bytes("current", 2) == 6
    current = compute.layer_cost(LLAMA, 2, H100, precision="bf16", fp8="current")
    assert current.forward.time_s > fp8.forward.time_s
    assert current.backward.time_s > fp8.backward.time_s


def test_fp8_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        compute.layer_cost(LLAMA, 1, labsim.gpu("A100-80GB"), fp8="delayed")
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        labsim.estimate_step(LLAMA, labsim.dgx_a100(1), labsim.Plan(dp=8, fp8="delayed"))
    for bad in ("e4m3", "mxfp8", 1):
        with pytest.raises(ValueError, match="choose one of"):
            labsim.Plan(dp=8, fp8=bad)
    with pytest.raises(ValueError, match="16-bit"):
        labsim.Plan(dp=8, fp8="delayed", precision="fp32")
    assert FP8_RECIPES == ("delayed", "current", "blockwise")


def test_per_block_scaling_costs_its_scales_a_second_quantization_and_gemm_time() -> None:
    """DeepSeek-V3's 1 x 128 / 128 x 128 scaling (labsim.fp8): an fp32 scale per 128
    elements of each copy, the fused inputs quantized again along the other axis, and the
    GEMMs slower by the published block-scaled kernel's shortfall (1550 against 1609
    TFLOP/s)."""
    assert cast_bytes("blockwise", 2) == pytest.approx(4 + 8 / 128)
    assert fused_input_bytes("blockwise", 2) == pytest.approx(3 + 4 / 128)
    assert fused_input_bytes("delayed", 2) == TRANSPOSE_BYTES
    assert gemm_slowdown("blockwise") == pytest.approx(1609 / 1550)
    assert gemm_slowdown("delayed") == gemm_slowdown(None) == 1.0
    tensor = compute.layer_cost(LLAMA, 2, H100, fp8="delayed")
    block = compute.layer_cost(LLAMA, 2, H100, fp8="blockwise")
    bf16 = compute.layer_cost(LLAMA, 2, H100)
    assert tensor.forward.time_s < block.forward.time_s < bf16.forward.time_s
    assert block.forward.flops == tensor.forward.flops
    plan = dict(dp=8, micro_batch=2, global_batch=64, software="megatron-core-te")
    steps = {r: labsim.estimate_step(LLAMA, labsim.dgx_h100(1), labsim.Plan(**plan, fp8=r))
             .step_time_s for r in (None, "delayed", "blockwise")}
    assert steps["delayed"] < steps["blockwise"] < steps[None]


def test_fp8_speeds_the_step_but_not_its_communication_or_attention() -> None:
    """NeMo 24.11's Nemotron-4 15B at its published layout: FP8 takes 2.08 s against BF16's
    2.83 s (1.36x); labsim's model the same way."""
    bf16 = next(r for r in runs() if r.id == "dgxc2411_nemotron4_15b_bf16_16gpu")
    fp8 = next(r for r in runs() if r.id == "dgxc2411_nemotron4_15b_fp8_16gpu")
    assert fp8.plan == replace(bf16.plan, fp8="delayed")
    a = labsim.estimate_step(bf16.model, bf16.cluster, bf16.plan)
    b = labsim.estimate_step(fp8.model, fp8.cluster, fp8.plan)
    measured = bf16.measured_step_s() / fp8.measured_step_s()
    assert measured == pytest.approx(1.36, abs=0.01)
    assert a.step_time_s / b.step_time_s == pytest.approx(measured, rel=0.07)
    assert b.memory == a.memory  # FP8 weights and their transposes: the bf16 weights' bytes
    assert b.breakdown.get("comm", 0) == pytest.approx(a.breakdown.get("comm", 0), rel=0.3)
