"""Mixture-of-experts layers in the step (no expert parallelism yet): every expert on every GPU
of a data-parallel replica, split over tensor parallelism like a dense MLP; the step's FLOPs,
parameters and memory count experts as the workload does."""

from __future__ import annotations

from dataclasses import replace

import pytest

import labsim
from labsim import compute
from labsim.memory import activation_per_layer, stage_params

MIXTRAL = labsim.Transformer.preset("mixtral-8x7b", seq_len=4096)
DEEPSEEK = labsim.Transformer.preset("deepseek-moe-16b")
H100 = labsim.gpu("H100-SXM")


def _plan(**kw) -> labsim.Plan:
    fields = dict(dp=4, tp=4, pp=4, micro_batch=1, global_batch=64, recompute="full",
                  sequence_parallel=True, software="megatron-core-te", zero_stage=1)
    return labsim.Plan(**{**fields, **kw})


def test_an_moe_layer_computes_its_active_flops_in_small_gemms() -> None:
    moe = compute.layer_cost(MIXTRAL, 1, H100, moe=True)
    per_token = (MIXTRAL.flops_forward_per_token * MIXTRAL.seq_len
                 - MIXTRAL.head_gemm(1).flops) / MIXTRAL.layers
    assert moe.forward.flops == pytest.approx(per_token, rel=1e-12)
    assert moe.backward.flops == pytest.approx(2 * per_token, rel=1e-12)
    # the same active FLOPs as one dense MLP of top_k experts' width: the experts' GEMMs are
    # smaller (fewer rows each), so they take longer
    twin = replace(MIXTRAL, experts=0, top_k=0, expert_ffn_hidden=None, shared_experts=0,
                   shared_ffn_hidden=None, ffn_hidden=2 * 14336)
    dense = compute.layer_cost(twin, 1, H100)
    assert moe.forward.time_s > dense.forward.time_s
    with pytest.raises(ValueError, match="moe=None"):
        compute.layer_cost(MIXTRAL, 1, H100)
    with pytest.raises(ValueError, match="moe=True"):
        compute.layer_cost(labsim.Transformer.preset("llama2-7b"), 1, H100, moe=True)
    with pytest.raises(ValueError, match="op-sac"):
        compute.layer_cost(MIXTRAL, 1, H100, moe=True, recompute="op-sac")
    rows = {name: m for name, m, *_ in compute.moe_linears(MIXTRAL, 4096)}
    assert rows["expert_up"] == 4096 * 2 / 8 and rows["router"] == 4096


def test_every_stage_holds_its_experts_and_the_stages_add_up() -> None:
    for model in (MIXTRAL, DEEPSEEK):
        assert stage_params(model) == model.params
        pp = 4 if model.layers % 4 == 0 else 7
        stages = sum(stage_params(model, pp=pp, stage=s) for s in range(pp))
        assert stages == model.params
    first, second = (stage_params(DEEPSEEK, pp=4, stage=s) for s in (0, 1))
    assert first - DEEPSEEK.vocab * DEEPSEEK.hidden == (
        second - (DEEPSEEK.moe_params_per_layer - DEEPSEEK.params_per_layer))


def test_an_moe_layer_keeps_the_routed_copies_and_the_experts_tensors() -> None:
    m, b = DEEPSEEK, 2
    sbh = m.seq_len * b * m.hidden
    moe = activation_per_layer(m, micro_batch=b, moe=True, attention="flash")
    dense = activation_per_layer(m, micro_batch=b, moe=False, attention="flash")
    f_dense, f_e = m.ffn_hidden / m.hidden, m.expert_ffn_hidden / m.hidden
    mlp = 2 * (6 * 4 * f_e + 2 * 4 * f_e) + 2 * 6 + 4 * 64 / m.hidden
    assert moe - dense == pytest.approx(sbh * (mlp - 2 * 4 * f_dense), rel=1e-12)
    with pytest.raises(ValueError, match="moe=None"):
        activation_per_layer(m, micro_batch=1)


def test_both_faces_price_an_moe_step_alike_and_count_active_flops() -> None:
    cluster, plan = labsim.dgx_h100(8), _plan()
    est = labsim.estimate_step(MIXTRAL, cluster, plan)
    sim = labsim.simulate_step(MIXTRAL, cluster, plan)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.02)
    assert est.memory == sim.memory and est.fits
    tokens = plan.global_batch * MIXTRAL.seq_len
    flops = MIXTRAL.flops_per_token * tokens
    # the router runs whole on every TP rank: 0.02 % more than the model's FLOPs
    assert est.mfu == pytest.approx(
        flops / est.step_time_s / (cluster.world_size * H100.peak("bf16")), rel=1e-3)
    assert 0.1 < est.mfu < est.hfu < 0.9
    assert "three published runs only" in est.band.describe()  # the band is the dense runs'
    dense = labsim.estimate_step(labsim.Transformer.preset("llama2-7b"), cluster, plan)
    assert "MoE" not in dense.band.describe()


def test_deepseek_moe_s_dense_first_layer_is_priced_as_dense() -> None:
    cluster = labsim.dgx_h100(1)
    plan = labsim.Plan(dp=2, pp=4, micro_batch=1, global_batch=16, recompute="full")
    c = labsim.step.step_costs(DEEPSEEK, cluster, plan)
    moe = compute.layer_cost(DEEPSEEK, 1, H100, moe=True, recompute="full",
                             sustained=c.sustained)
    dense = compute.layer_cost(DEEPSEEK, 1, H100, moe=False, recompute="full",
                               sustained=c.sustained)
    first, middle = c.chunks[0], c.chunks[1]
    assert first.layers == middle.layers == 7
    assert first.t_rec - middle.t_rec == pytest.approx(
        dense.recompute.time_s - moe.recompute.time_s, rel=1e-9)
    with pytest.raises(ValueError, match="leading dense layers"):
        labsim.estimate_step(replace(DEEPSEEK, dense_layers=8), cluster, plan)
    with pytest.raises(ValueError, match="zero_stage=3"):
        labsim.estimate_step(DEEPSEEK, cluster, labsim.Plan(dp=8, zero_stage=3))
