"""Step memory against the peaks torchtitan published for Llama 3.1 8B on H100.

torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (torch 1963fc8, torchtitan
9dec370, 2024-12): Llama 3.1 8B, FSDP, local batch 2, sequence 8192 (``train_configs/
llama3_8b.toml``), selective activation checkpointing with ``selective_ac_option = 'op'``, bf16
parameters and fp32 reduction (FSDP2 ``MixedPrecisionPolicy``), AdamW, eager: Table 1 (8 GPUs)
82.4 GiB, Table 3 (128 GPUs) 67.0 GiB.  The memory column is the caching allocator's peak
reserved bytes (``torchtitan/metrics.py``: ``reserved_bytes.all.peak``, in GiB = 2**30 B).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import labsim
from labsim import Plan, Transformer
from labsim.memory import activation_per_layer, loss_memory, step_memory
from labsim.op_sac import op_sac_per_layer
from labsim.published import runs

GIB = 2**30
LLAMA31_8B = Transformer(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                         vocab=128256, seq_len=8192, swiglu=True, positions="rotary",
                         norm="rmsnorm", bias=False, dropout=False, name="Llama 3.1 8B")


def _plan(gpus: int, recompute: str = "op-sac") -> Plan:
    return Plan(dp=gpus, micro_batch=2, global_batch=2 * gpus, zero_stage=3,
                recompute=recompute, precision="bf16", attention="flash",
                software="torchtitan-2024")


def test_op_sac_keeps_the_blocks_input_and_every_other_matmul() -> None:
    """Per token of a Llama 3.1 8B block: the input, wq's, wv's, w1's and w2's outputs, the
    SDPA output (bf16) and its fp32 log-sum-exp: 2 (4h + kv + f) + 4a bytes."""
    m = LLAMA31_8B
    per_token = activation_per_layer(m, micro_batch=2, recompute="op-sac",
                                     attention="flash") / (2 * m.seq_len)
    assert per_token == 2 * (4 * m.hidden + m.kv_dim + m.ffn_hidden) + 4 * m.heads == 63_616
    selective = activation_per_layer(m, micro_batch=2, recompute="selective", attention="flash")
    assert 2 * m.seq_len * per_token < selective / 2
    # tensor parallel with sequence parallelism: column-parallel outputs split, the
    # row-parallel w2 output whole, the input and the two reduce-scatter outputs split
    tp = op_sac_per_layer(m, micro_batch=1, tp=2, sequence_parallel=True)
    sb = m.seq_len
    assert tp == 2 * sb * (4096 / 2 + 4096 / 2 + 1024 / 2 + 4096 / 2 + 14336 / 2 + 4096
                           + 2 * 4096 / 2) + 4 * 32 * sb / 2


def test_a_biased_model_saves_no_projection() -> None:
    """Linear layers with bias run aten.addmm, which torchtitan's save list does not name."""
    gpt = Transformer.preset("gpt2-124m")
    kept = op_sac_per_layer(gpt, micro_batch=1)
    s, h = gpt.seq_len, gpt.hidden
    assert kept == 2 * s * (h + h) + 4 * gpt.heads * s  # input, SDPA output, log-sum-exp


@pytest.mark.parametrize("run_id", ["torchtitan2024_llama31_8b_fsdp_8gpu",
                                    "torchtitan2024_llama31_8b_fsdp_128gpu"])
def test_torchtitan_llama31_8b_fsdp_peak_within_ten_percent(run_id: str) -> None:
    """The published runs as shipped (``labsim.published``: 82.4 and 67.0 GiB) on their
    cluster, plan and the torchtitan-2024 profile (eager loss)."""
    run = next(r for r in runs() if r.id == run_id)
    assert run.plan.software == "torchtitan-2024" and run.plan.recompute == "op-sac"
    result = labsim.estimate_step(run.model, run.cluster, run.plan)
    assert result.memory is not None and result.fits
    published = run.measured["peak_memory_gib"]
    assert result.peak_memory_bytes / GIB == pytest.approx(published, rel=0.10)
    # the layers' activations and the loss: the first before the second, all held at once
    loss = loss_memory(run.model, micro_batch=2, kernel="eager")
    assert result.memory.activations == pytest.approx(
        32 * activation_per_layer(run.model, micro_batch=2, recompute="op-sac",
                                  attention="flash") + loss)


def test_simulated_step_runs_with_op_sac_and_recomputes_three_matmuls() -> None:
    cluster = labsim.dgx_h100(1)
    sim = labsim.simulate_step(LLAMA31_8B, cluster, _plan(8))
    est = labsim.estimate_step(LLAMA31_8B, cluster, _plan(8))
    none = labsim.estimate_step(LLAMA31_8B, cluster, _plan(8, "none"))
    full = labsim.estimate_step(LLAMA31_8B, cluster, _plan(8, "full"))
    assert sim.memory == est.memory
    assert none.step_time_s < est.step_time_s < full.step_time_s
    assert step_memory(LLAMA31_8B, _plan(8, "full"), 1).activations < est.memory.activations


def test_recompute_flops_overhead_of_op_sac() -> None:
    """wk, wo and w3 again: 2 (kv h + h h + f h) FLOPs a token per layer."""
    from labsim.checkpointing import recompute_flops_overhead

    m = LLAMA31_8B
    again = 2 * (m.kv_dim * m.hidden + m.hidden**2 + m.ffn_hidden * m.hidden) * m.layers
    assert recompute_flops_overhead(m, "op-sac") == pytest.approx(again / m.flops_per_token)
    assert 0 < recompute_flops_overhead(m, "op-sac") < recompute_flops_overhead(m, "full")


def test_the_loss_kernel_sets_what_the_logits_hold() -> None:
    """Bytes per logit at the start of backward, bf16 compute: eager F.cross_entropy on an
    fp32 copy 2 + 3 x 4, Megatron's vocabulary-parallel kernel 2 + 4, flash-attn's fused
    kernel 2 x 2; the vocabulary splits over TP; each profile names its kernel."""
    m = LLAMA31_8B
    logits = m.seq_len * 2 * m.vocab
    for kernel, per_logit in (("eager", 14), ("megatron", 6), ("flash-attn", 4)):
        assert loss_memory(m, micro_batch=2, kernel=kernel) == logits * per_logit
    assert loss_memory(m, micro_batch=2, tp=2, kernel="megatron") == logits / 2 * 6
    with pytest.raises(ValueError, match="flash-attn"):
        loss_memory(m, micro_batch=2, kernel="fused")
    from labsim.software import PROFILES, SoftwareProfile

    kernels = {name: p.cross_entropy for name, p in PROFILES.items()}
    assert kernels["torchtitan-2024"] == kernels["generic"] == "eager"
    assert kernels["fsdp"] == kernels["fsdp-torch1.13"] == "flash-attn"
    assert {kernels[n] for n in PROFILES if n.startswith(("megatron", "deepspeed"))} == {
        "megatron"}
    with pytest.raises(ValueError, match="cross_entropy"):
        SoftwareProfile("mine", "", {"hopper": 0.7}, cross_entropy="liger")
    # the same plan holds less with Megatron's loss than with the eager one
    eager = labsim.estimate_step(m, labsim.dgx_h100(1), _plan(8)).memory
    megatron = labsim.estimate_step(m, labsim.dgx_h100(1), replace(
        _plan(8), software="megatron-core-te")).memory
    assert megatron.activations < eager.activations
