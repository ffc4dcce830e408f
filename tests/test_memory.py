"""Memory: the ZeRO paper's worked example, Korthikanti et al.'s Table 2, validation."""

from __future__ import annotations

import pytest

from labsim.memory import (
    MemoryBreakdown,
    activation_memory,
    activation_per_layer,
    bytes_per_param,
    loss_memory,
    stage_params,
    step_memory,
    training_memory,
    zero3_unit_params,
)
from labsim.workload import Transformer

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_worked_example(stage: int, expected_gb: float) -> None:
    # Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12.
    mem = training_memory(7.5e9, precision="mixed", optimizer="adam", zero_stage=stage, dp=64)
    assert round(mem.model_states / GB, 1) == expected_gb
    assert mem.activations == 0 and mem.total == mem.model_states


def test_bytes_per_param_table() -> None:
    assert sum(bytes_per_param("mixed", "adam")) == 16
    assert sum(bytes_per_param("mixed-fp32-grads", "adam")) == 18
    assert bytes_per_param("fp32", "adam") == (4, 4, 8)
    assert bytes_per_param("pure-bf16", "adam") == (2, 2, 4)  # no fp32 master copy
    # NeMo's distributed Adam: fp32 gradients, the master as bf16 weight + 16-bit remainder
    assert bytes_per_param("mixed-fp32-grads-remainders", "adam") == (2, 4, 10)
    assert bytes_per_param("bf16", "adam") == bytes_per_param("mixed", "adam")  # one vocabulary
    assert bytes_per_param("autocast-bf16", "adam") == (4, 4, 8)  # torch.amp: fp32 weights
    assert bytes_per_param("fp32", "sgd") == (4, 4, 0)
    assert bytes_per_param("mixed", "sgd") == (2, 2, 4)  # the fp32 master copy remains
    assert bytes_per_param("fp32", "sgd-momentum") == (4, 4, 4)


def test_seven_b_fp32_adam() -> None:
    # 7B parameters in fp32 with Adam: 28 GB weights + 28 GB gradients + 56 GB moments.
    mem = training_memory(7e9, precision="fp32")
    assert (mem.params, mem.grads, mem.optimizer) == (28 * GB, 28 * GB, 56 * GB)
    assert mem.model_states == 112 * GB


def test_dp_without_zero_replicates() -> None:
    assert training_memory(1e9, dp=8) == training_memory(1e9, dp=1)


def test_stage_params_degenerate_and_tp() -> None:
    for name in ("gpt2-124m", "llama2-7b", "llama2-70b"):
        m = Transformer.preset(name)
        assert stage_params(m) == m.params
    m = Transformer.preset("gpt3-175b")
    stages = [stage_params(m, pp=8, stage=i) for i in range(8)]
    # tied embeddings: the last stage keeps its own copy of the word embedding (Megatron)
    assert sum(stages) == m.params + m.vocab * m.hidden
    tp8 = stage_params(m, tp=8)
    assert m.params / 8 < tp8 < m.params / 8 * 1.01


def test_stage_params_of_a_stage_given_its_layers() -> None:
    """With the embedding counted as a layer (``Plan.chunk_layers``) the first stage holds
    one layer less: its parameters drop by exactly one layer's."""
    m = Transformer.preset("llama2-7b")
    even = stage_params(m, tp=2, pp=4, stage=0)
    fewer = stage_params(m, tp=2, pp=4, stage=0, layers=m.layers // 4 - 1)
    layer = stage_params(m, tp=2, pp=4, stage=1) - stage_params(
        m, tp=2, pp=4, stage=1, layers=m.layers // 4 - 1)
    assert even - fewer == layer > 0
    assert stage_params(m, pp=m.layers + 2, stage=0, layers=0) == m.vocab * m.hidden
    with pytest.raises(ValueError, match="layers=-1"):
        stage_params(m, pp=4, layers=-1)


def test_model_with_activations() -> None:
    m = Transformer.preset("gpt2-124m")
    mem = training_memory(m, micro_batch=4)
    assert mem.params == 2 * m.params
    assert mem.activations == activation_memory(m, micro_batch=4)
    fp32 = training_memory(m, precision="fp32", micro_batch=4)
    assert fp32.activations == activation_memory(m, micro_batch=4, dtype_bytes=4)


def _table2(m: Transformer, b: int, t: int) -> dict[str, float]:
    s, h, a = m.seq_len, m.hidden, m.heads
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": sbh * (34 / t + 5 * a * s / (h * t)),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": sbh * 34 / t,
        "full": 2 * sbh,
    }


def test_korthikanti_table2() -> None:
    m = Transformer.preset("gpt3-175b")
    ref = _table2(m, b=1, t=8)
    f = activation_per_layer
    assert f(m, micro_batch=1) == pytest.approx(ref["none"])
    assert f(m, micro_batch=1, tp=8) == pytest.approx(ref["tp"])
    assert f(m, micro_batch=1, tp=8, sequence_parallel=True) == pytest.approx(ref["tp+sp"])
    assert f(m, micro_batch=1, tp=8, recompute="selective") == pytest.approx(ref["tp+selective"])
    assert f(m, micro_batch=1, tp=8, sequence_parallel=True, recompute="selective") == (
        pytest.approx(ref["tp+sp+selective"]))
    assert f(m, micro_batch=1, tp=8, recompute="full") == pytest.approx(ref["full"])


def test_korthikanti_gpt3_first_stage() -> None:
    # Korthikanti et al. 2022, Sec. 5 / Fig. 7: GPT-3 175B with t=8, p=8 (L=96, s=2048, b=1);
    # TP + SP + selective keeps sbhL*34/t in the first stage.
    m = Transformer.preset("gpt3-175b")
    got = activation_memory(m, micro_batch=1, tp=8, pp=8, sequence_parallel=True,
                            recompute="selective")
    assert got == pytest.approx(2048 * 12288 * 96 * 34 / 8)


def test_interleaving_factor() -> None:
    m = Transformer.preset("megatron-145.6b")
    base = activation_memory(m, micro_batch=2, tp=8, pp=8)
    inter = activation_memory(m, micro_batch=2, tp=8, pp=8, virtual_stages=2)
    assert inter == pytest.approx(base * (1 + 7 / 16))
    assert activation_memory(m, micro_batch=2, pp=1, virtual_stages=2) == (
        activation_memory(m, micro_batch=2))


def test_activations_scale_with_batch_and_tp() -> None:
    m = Transformer.preset("gpt2-124m")
    assert activation_memory(m, micro_batch=8) == 8 * activation_memory(m, micro_batch=1)
    assert activation_memory(m, micro_batch=1, tp=4, sequence_parallel=True) == pytest.approx(
        activation_memory(m, micro_batch=1) / 4)


def test_breakdown_repr_and_fits() -> None:
    mem = MemoryBreakdown(1e9, 2e9, 3e9, 4e9)
    assert mem.total == 10e9 and mem.model_states == 6e9
    assert "total=10 GB" in repr(mem)
    assert mem.fits(80e9) and not mem.fits(9e9)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(zero_stage=4), "stages 0, 1, 2 and 3"),
        (dict(precision="fp8"), "precision"),
        (dict(optimizer="lion"), "optimizer"),
        (dict(dp=0), "dp"),
        (dict(micro_batch=2), "need a Transformer"),
    ],
)
def test_training_memory_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        training_memory(1e9, **kwargs)


def test_negative_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        training_memory(-1)
    with pytest.raises(ValueError, match="parameter count"):
        training_memory("seven billion")
    with pytest.raises(ValueError, match="parameter count"):
        training_memory("7e9")  # a string, even a numeric one, is not a count
    with pytest.raises(ValueError, match="finite"):
        training_memory(float("nan"))
    with pytest.raises(ValueError, match="parameter count"):
        training_memory(True)
    with pytest.raises(ValueError, match="zero_stage"):
        training_memory(1e9, zero_stage=True)
    m = Transformer.preset("gpt2-124m")
    with pytest.raises(ValueError, match="micro_batch"):
        activation_memory(m, micro_batch=0)
    with pytest.raises(ValueError, match="recompute"):
        activation_memory(m, micro_batch=1, recompute="some")
    with pytest.raises(ValueError, match="pp=5"):
        activation_memory(m, micro_batch=1, pp=5)
    with pytest.raises(ValueError, match="micro_batch"):
        training_memory(m, recompute="full")
    sharded = training_memory(m, tp=4, pp=2)
    assert sharded.activations == 0
    assert sharded.params == 2 * stage_params(m, tp=4, pp=2)


def test_dropout_free_models_keep_no_masks() -> None:
    llama = Transformer.preset("llama2-7b")
    assert not llama.dropout
    s, h, a, f = llama.seq_len, llama.hidden, llama.heads, llama.ffn_hidden
    # SwiGLU keeps gate, up, silu(gate) and their product (4f); K, V as wide as Q; without
    # dropout the softmax output is kept once (2 bytes per score), not twice
    split = 2 * (2 * h + 2 * h + 4 * f)
    assert activation_per_layer(llama, micro_batch=1) == pytest.approx(
        s * (8 * h + split) + a * s * s * 2)
    with pytest.raises(ValueError, match="without dropout"):
        activation_per_layer(llama, micro_batch=1, mask_bytes=1)


def test_a_fused_swiglu_keeps_one_f_wide_tensor_fewer() -> None:
    llama, gpt = Transformer.preset("llama2-70b"), Transformer.preset("gpt3-175b")
    s, f = llama.seq_len, llama.ffn_hidden
    for tp, sp in ((1, False), (8, False), (8, True)):
        kw = {"micro_batch": 2, "tp": tp, "sequence_parallel": sp, "attention": "flash"}
        assert activation_per_layer(llama, **kw) - activation_per_layer(
            llama, swiglu_fused=True, **kw) == pytest.approx(2 * s * 2 * f / tp)
        assert activation_per_layer(gpt, swiglu_fused=True, **kw) == \
            activation_per_layer(gpt, **kw)  # a GeLU MLP has no SwiGLU to fuse
    assert activation_per_layer(llama, micro_batch=1, recompute="full", swiglu_fused=True) == \
        activation_per_layer(llama, micro_batch=1, recompute="full")


def test_a_recomputing_step_holds_one_layer_whole_as_the_segment_model_says() -> None:
    """With every layer checkpointed, the peak is every checkpoint plus the layer being
    recomputed, whole: ``labsim.checkpointing.segment_peak_bytes`` with one layer per segment
    (the model lab 03 measures against PyTorch), not Korthikanti et al.'s per-layer count
    alone.  Selective recomputation holds one layer's recomputed attention core."""
    from labsim.checkpointing import segment_peak_bytes
    from labsim.plan import Plan

    model = Transformer.preset("gpt3-175b")
    for recompute, attention in (("full", "standard"), ("full", "flash"),
                                 ("selective", "standard")):
        plan = Plan(tp=8, micro_batch=2, global_batch=2, recompute=recompute,
                    attention=attention, sequence_parallel=True)
        kw = {"micro_batch": 2, "tp": 8, "sequence_parallel": True, "attention": attention}
        whole = activation_per_layer(model, **kw)
        kept = activation_per_layer(model, recompute=recompute, **kw)
        held = step_memory(model, plan, 1).activations
        # one stage: the loss's peak (loss_memory) comes before the first recomputed layer's
        loss = loss_memory(model, micro_batch=2, tp=8)
        segments = segment_peak_bytes([whole] * model.layers, [kept] * model.layers,
                                      range(model.layers))
        assert held == pytest.approx(max(segments, model.layers * kept + loss))
        assert held == pytest.approx(model.layers * kept + max(whole - kept, loss)) and held > (
            model.layers * kept)
    none = Plan(tp=8, micro_batch=2, global_batch=2, attention="flash")
    assert step_memory(model, none, 1).activations == pytest.approx(
        model.layers * activation_per_layer(model, micro_batch=2, tp=8, attention="flash")
        + loss_memory(model, micro_batch=2, tp=8))


def test_zero3_holds_its_units_whole_a_tensor_for_deepspeed_a_layer_for_fsdp() -> None:
    from labsim.plan import Plan

    model = Transformer.preset("megatron-529.6b")
    tensors = zero3_unit_params(model, 1, "tensor")
    # the four weight matrices: all but the biases (3h, h, 4h, h) and two norms (2 x 2h)
    assert model.params_per_layer - sum(tensors) == 13 * model.hidden
    assert zero3_unit_params(model, 1, "layer") == (model.params_per_layer,)
    plan = Plan(dp=64, micro_batch=1, global_batch=64, zero_stage=3, recompute="full",
                zero3_prefetch=0, precision="fp16")
    sharded = training_memory(float(stage_params(model)), precision="fp16", zero_stage=3,
                              dp=64).params
    layer = step_memory(model, plan, 1).params - sharded
    tensor = step_memory(model, plan, 1, zero3_unit="tensor").params - sharded
    # FSDP's root unit (embedding, final norm, output layer) also stays whole
    root = stage_params(model, layers=0)
    assert layer == pytest.approx(2 * 2 * model.params_per_layer + 2 * root)
    assert tensor == pytest.approx(2 * 2 * max(tensors)) and tensor < layer / 2
    with pytest.raises(ValueError, match="'layer' or 'tensor'"):
        zero3_unit_params(model, 1, "module")


def test_llama_7b_fp32_activations() -> None:
    # One 2048-token sequence in fp32: ~20 GB with FlashAttention, ~37 GB with the scores
    llama = Transformer.preset("llama-7b")
    flash = activation_memory(llama, micro_batch=1, dtype_bytes=4, attention="flash")
    stored = activation_memory(llama, micro_batch=1, dtype_bytes=4)
    assert flash == pytest.approx(20.2e9, rel=0.01)
    assert stored == pytest.approx(37.4e9, rel=0.01)


def test_flash_keeps_the_log_sum_exp_instead_of_the_scores() -> None:
    m = Transformer.preset("gpt2-124m")
    s, a = m.seq_len, m.heads
    flash = activation_per_layer(m, micro_batch=2, attention="flash")
    selective = activation_per_layer(m, micro_batch=2, recompute="selective")
    assert flash - selective == pytest.approx(4 * a * s * 2)
    with pytest.raises(ValueError, match="attention"):
        activation_per_layer(m, micro_batch=1, attention="sparse")


def test_grouped_query_attention_keeps_narrower_k_and_v() -> None:
    gqa = Transformer.preset("llama2-70b")  # 8 of 64 heads for K and V
    full = Transformer(gqa.layers, gqa.hidden, gqa.heads, gqa.seq_len, gqa.vocab,
                       ffn_hidden=gqa.ffn_hidden, swiglu=True, dropout=False)
    s, h = gqa.seq_len, gqa.hidden
    saved = 2 * 2 * (h - gqa.kv_dim) * s  # K and V, 2 bytes each, per token
    assert activation_per_layer(full, micro_batch=1, recompute="selective") - \
        activation_per_layer(gqa, micro_batch=1, recompute="selective") == pytest.approx(saved)


# ---------------------------------------------------------------- properties
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(
    n=st.floats(min_value=0, max_value=1e13),
    dp=st.integers(min_value=1, max_value=4096),
    precision=st.sampled_from(["fp32", "mixed", "mixed-fp32-grads", "bf16"]),
    optimizer=st.sampled_from(["adam", "sgd", "sgd-momentum"]),
)
def test_zero_never_increases_memory(n: float, dp: int, precision: str, optimizer: str) -> None:
    totals = [training_memory(n, precision=precision, optimizer=optimizer, zero_stage=s,
                              dp=dp).total for s in range(4)]
    assert all(a >= b for a, b in zip(totals, totals[1:]))
    # sharding conserves bytes: dp ranks of ZeRO-3 hold exactly one unsharded copy
    assert totals[3] * dp == pytest.approx(totals[0], rel=1e-12)


@given(b=st.integers(1, 16), t=st.sampled_from([1, 2, 4, 8]),
       recompute=st.sampled_from(["none", "selective", "full"]), sp=st.booleans())
def test_activation_orderings(b: int, t: int, recompute: str, sp: bool) -> None:
    m = Transformer.preset("megatron-18.4b")
    mem = activation_memory(m, micro_batch=b, tp=t, sequence_parallel=sp, recompute=recompute)
    assert mem == pytest.approx(b * activation_memory(m, micro_batch=1, tp=t,
                                                      sequence_parallel=sp, recompute=recompute))
    none = activation_memory(m, micro_batch=b, tp=t, sequence_parallel=sp)
    selective = activation_memory(m, micro_batch=b, tp=t, sequence_parallel=sp,
                                  recompute="selective")
    full = activation_memory(m, micro_batch=b, tp=t, sequence_parallel=sp, recompute="full")
    assert full <= selective <= none
