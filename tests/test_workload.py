"""Transformer: exact parameter counts against published configs, FLOPs against Megatron."""

from __future__ import annotations

import pytest

from labsim.workload import PRESETS, Gemm, Transformer


def test_gpt2_small_exact() -> None:
    # Hugging Face GPT2LMHeadModel("gpt2"): 124,439,808 parameters (lm_head tied to wte).
    m = Transformer.preset("gpt2-124m")
    assert m.params == 124_439_808
    assert m.seq_len == 1024 and m.tied_embeddings
    assert m.embedding_params == 50257 * 768 + 1024 * 768


def test_llama2_exact() -> None:
    # Meta's Llama-2 checkpoints (HF LlamaForCausalLM): exact counts.
    assert Transformer.preset("llama2-7b").params == 6_738_415_616
    assert Transformer.preset("llama2-13b").params == 13_015_864_320
    assert Transformer.preset("llama2-70b").params == 68_976_648_192


def test_llama_by_hand() -> None:
    m = Transformer.preset("llama2-7b")
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert m.params == 32 * layer + 2 * 32000 * 4096 + 4096


def test_gqa_shrinks_kv_projection() -> None:
    full = Transformer(2, 512, 8, 128, 1000, swiglu=True, bias=False)
    gqa = Transformer(2, 512, 8, 128, 1000, kv_heads=2, swiglu=True, bias=False)
    # K and V each lose (8 - 2) heads x 64 dims x 512 inputs, per layer.
    assert full.params - gqa.params == 2 * 2 * 6 * 64 * 512


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith(("megatron", "gpt"))])
def test_megatron_formula(name: str) -> None:
    # Narayanan et al. 2021: P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)); it leaves out the
    # final LayerNorm (2h).
    m = Transformer.preset(name)
    assert m.params - 2 * m.hidden == pytest.approx(m.megatron_params(), rel=1e-12)


@pytest.mark.parametrize(
    "name, billions",
    [("megatron-1.7b", 1.7), ("megatron-7.5b", 7.5), ("megatron-18.4b", 18.4),
     ("megatron-145.6b", 145.6), ("megatron-529.6b", 529.6), ("megatron-1t", 1008.0)],
)
def test_megatron_table1_sizes(name: str, billions: float) -> None:
    assert round(Transformer.preset(name).params / 1e9, 1) == pytest.approx(billions, abs=0.051)


def test_gpt3_near_175b() -> None:
    assert 174e9 < Transformer.preset("gpt3-175b").params < 176e9


@pytest.mark.parametrize("name", ["gpt3-175b", "megatron-1t", "gpt2-124m"])
def test_flops_equal_megatron_model_flops(name: str) -> None:
    # Model FLOPs per token without recomputation: 72 l h^2 (1 + s/(6h) + V/(12lh)).
    m = Transformer.preset(name)
    L, h, s, v = m.layers, m.hidden, m.seq_len, m.vocab  # noqa: N806
    assert m.flops_per_token == pytest.approx(
        72 * L * h * h * (1 + s / (6 * h) + v / (12 * L * h)))
    assert m.flops_backward_per_token == 2 * m.flops_forward_per_token
    # with full recomputation: 96 l h^2 (1 + s/(6h) + V/(16lh)) per token
    assert m.training_flops(1, recompute="full") == pytest.approx(
        96 * L * h * h * (1 + s / (6 * h) + v / (16 * L * h)))


def test_six_n_rule_for_large_models() -> None:
    m = Transformer.preset("llama2-70b")
    assert 6 < m.flops_per_token / m.params < 6.5


def test_layer_gemms_sum_and_tp_split() -> None:
    m = Transformer.preset("gpt3-175b")
    one = m.layer_gemms(micro_batch=2, tp=1)
    eight = m.layer_gemms(micro_batch=2, tp=8)
    # tensor parallelism splits every GEMM's work evenly
    assert sum(g.flops for g in one) == 8 * sum(g.flops for g in eight)
    names = [g.name for g in one]
    assert names == ["qkv", "attn_scores", "attn_values", "attn_out", "mlp_up", "mlp_down"]
    qkv = eight[0]
    assert (qkv.m, qkv.n, qkv.k) == (2 * 2048, 3 * 12288 // 8, 12288)
    assert m.attention_core_flops(2, 1) == 4 * 2 * 2048**2 * 12288
    total = m.layers * sum(g.flops for g in one) + m.head_gemm(2).flops
    assert total == pytest.approx(2 * 2048 * m.flops_forward_per_token)


def test_backward_gemms_are_twice_the_forward() -> None:
    m = Transformer.preset("llama2-70b")
    fwd = m.layer_gemms(2, tp=8)
    bwd = m.layer_gemms_backward(2, tp=8)
    assert len(bwd) == 2 * len(fwd)
    assert sum(g.flops for g in bwd) == 2 * sum(g.flops for g in fwd)
    qkv_w = next(g for g in bwd if g.name == "qkv.wgrad")
    # the weight gradient has the weight's shape: hidden x (q + 2 kv) / tp
    assert (qkv_w.m, qkv_w.n) == (8192, (64 // 8 + 2) * 128)


def test_swiglu_gqa_gemms() -> None:
    m = Transformer.preset("llama2-70b")
    gemms = {g.name: g for g in m.layer_gemms(1, tp=8)}
    assert gemms["qkv"].n == (64 // 8 + 2 * 1) * 128
    assert gemms["mlp_gate_up"].n == 2 * 28672 // 8
    assert gemms["mlp_down"].k == 28672 // 8


def test_gemm_counts() -> None:
    g = Gemm("x", 4, 5, 6, batch=3)
    assert g.flops == 2 * 3 * 4 * 5 * 6
    assert g.nbytes(2) == 3 * (24 + 30 + 20) * 2
    assert g.intensity(2) == g.flops / g.nbytes(2)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(layers=0), "layers"),
        (dict(hidden=100, heads=3), "multiple of heads"),
        (dict(kv_heads=3), "kv_heads"),
        (dict(vocab=-5), "vocab"),
        (dict(positions="alibi"), "positions"),
        (dict(norm="batchnorm"), "norm"),
    ],
)
def test_validation(kwargs: dict, words: str) -> None:
    base = dict(layers=2, hidden=64, heads=4, seq_len=16, vocab=100)
    with pytest.raises(ValueError, match=words):
        Transformer(**{**base, **kwargs})


def test_preset_errors_and_overrides() -> None:
    with pytest.raises(ValueError, match="gpt2-124m"):
        Transformer.preset("gpt-5")
    short = Transformer.preset("GPT2-124M", seq_len=256)
    assert short.params == 124_439_808 - (1024 - 256) * 768
    with pytest.raises(ValueError, match="tp=5"):
        Transformer.preset("gpt2-124m").layer_gemms(1, tp=5)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=50)
@given(
    layers=st.integers(1, 8), head_dim=st.sampled_from([8, 16, 64]), heads=st.integers(1, 8),
    groups=st.sampled_from([1, 2, 4]), seq=st.integers(1, 512), vocab=st.integers(1, 60000),
    tp=st.sampled_from([1, 2, 4]), swiglu=st.booleans(),
)
def test_tp_splits_layer_flops_evenly(layers: int, head_dim: int, heads: int, groups: int,
                                      seq: int, vocab: int, tp: int, swiglu: bool) -> None:
    heads *= groups * tp
    m = Transformer(layers, heads * head_dim, heads, seq, vocab, kv_heads=heads // groups,
                    swiglu=swiglu, ffn_hidden=4 * heads * head_dim)
    if m.kv_heads % tp:
        return
    one = sum(g.flops for g in m.layer_gemms(2, 1))
    split = sum(g.flops for g in m.layer_gemms(2, tp))
    assert one == tp * split
    assert m.flops_per_token == pytest.approx(3 * m.flops_forward_per_token)


# -- mixture of experts --------------------------------------------------------------------


def test_mixtral_counts_every_expert_and_activates_two() -> None:
    """Jiang et al. 2024: "47B parameters, but only uses 13B active parameters"; the count is
    exact for mistralai/Mixtral-8x7B-v0.1 (46,702,792,704)."""
    m = Transformer.preset("mixtral-8x7b")
    assert m.params == 46_702_792_704
    assert m.active_params == 12_879_925_248
    assert m.moe_layers == 32 and m.expert_params == 3 * 4096 * 14336
    assert m.params - m.active_params == 32 * 6 * m.expert_params
    big = Transformer.preset("mixtral-8x22b")  # "141B parameters ... 39B active"
    assert big.params / 1e9 == pytest.approx(141, rel=0.005)
    assert big.active_params / 1e9 == pytest.approx(39, rel=0.01)


def test_deepseek_moe_has_shared_experts_and_a_dense_first_layer() -> None:
    """Dai et al. 2024: DeepSeekMoE 16B, 16.4B parameters, 2.8B activated."""
    m = Transformer.preset("deepseek-moe-16b")
    assert m.moe_layers == 27 and m.dense_layers == 1
    assert m.params / 1e9 == pytest.approx(16.4, rel=0.005)
    assert m.active_params / 1e9 == pytest.approx(2.8, rel=0.015)
    expert = 3 * 2048 * 1408
    assert m.moe_params_per_layer - m.attention_params - 2 * m.norm_params == (
        (64 + 2) * expert + 2048 * 64)


@pytest.mark.parametrize("name, total, active, rel", [
    ("qwen1.5-moe-a2.7b", 14.3, 2.7, 0.005),  # "14.3B ... in total and 2.7B activated"
    ("qwen2-57b-a14b", 57, 14, 0.02),  # "57B ... 14B activated" (A14B)
    ("llama4-scout-17b-16e", 107.8, 17, 0.015),  # "17B active"; 109B with the vision encoder
])
def test_newer_moe_presets_reproduce_their_published_sizes(name: str, total: float,
                                                           active: float, rel: float) -> None:
    m = Transformer.preset(name)
    assert m.params / 1e9 == pytest.approx(total, rel=rel)
    assert m.active_params / 1e9 == pytest.approx(active, rel=rel)
    assert m.moe_layers == m.layers and m.shared_experts == 1


def test_qwen_moe_counts_its_experts_exactly() -> None:
    """Qwen1.5-MoE-A2.7B: 2.0B non-embedding activated parameters (its blog); per layer four
    h x h projections, 60 experts and one shared expert of SwiGLU, a router."""
    m = Transformer.preset("qwen1.5-moe-a2.7b")
    per_layer = 4 * 2048**2 + (60 * 1408 + 5632) * 3 * 2048 + 2048 * 60 + 2 * 2048
    assert m.moe_params_per_layer == per_layer
    assert (m.active_params - m.embedding_params - m.output_params) / 1e9 == pytest.approx(
        2.0, rel=0.04)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b", "llama2-7b",
                                  "llama4-scout-17b-16e"])
def test_moe_flops_count_the_active_experts_and_the_router(name: str) -> None:
    """Forward FLOPs per token = 2 x every active matrix parameter (embedding and norms
    excluded, the router and the output layer included) + the s x s attention core."""
    m = Transformer.preset(name, seq_len=256)
    norms = (2 * m.layers + 1) * m.norm_params
    matrices = m.active_params - m.embedding_params - norms
    core = m.layers * 4 * m.seq_len * m.hidden
    assert m.flops_forward_per_token == pytest.approx(2 * matrices + core, rel=1e-12)


def test_moe_layer_gemms_group_the_experts() -> None:
    m = Transformer.preset("deepseek-moe-16b", seq_len=1024)
    g = {x.name: x for x in m.moe_layer_gemms(micro_batch=2)}
    assert g["router"].m == 2048 and g["router"].n == 64
    assert g["expert_up"].batch == 64 and g["expert_up"].m == 2048 * 6 // 64
    assert g["expert_up"].n == 2 * 1408 and g["expert_down"].k == 1408
    assert g["shared_up"].batch == 2 and g["shared_up"].m == 2048
    assert Transformer.preset("llama2-7b").moe_layer_gemms() == ()
    assert "mixtral-8x7b" in Transformer.presets()
    assert "mixtral-8x7b" not in Transformer.presets(dense=True)


@pytest.mark.parametrize("fields, match", [
    ({"experts": 8, "top_k": 9}, "top_k=9"),
    ({"experts": 8}, "top_k=0"),
    ({"top_k": 2}, "set experts"),
    ({"shared_experts": 1}, "set experts"),
    ({"experts": 8, "top_k": 2, "dense_layers": 2}, "leaves no MoE layer"),
    ({"experts": -1}, "experts must be"),
])
def test_bad_moe_fields_name_the_fix(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Transformer(layers=2, hidden=64, heads=4, seq_len=16, vocab=100, **fields)


def test_llama4_maverick_alternates_dense_and_moe_layers() -> None:
    """Meta: "17B active parameters, 128 experts, 400B total" (with the vision encoder);
    Hugging Face's config puts the MoE layers at 1, 3, 5, ... (interleave_moe_layer_step 2)."""
    from labsim.moe import moe_layers_of
    m = Transformer.preset("llama4-maverick-17b-128e")
    assert m.moe_layers == 24 and [moe_layers_of(m, 1, i) for i in range(4)] == [0, 1, 0, 1]
    assert m.params / 1e9 == pytest.approx(400, rel=0.005)
    assert m.active_params / 1e9 == pytest.approx(17, rel=0.015)
    dense_block = m.attention_params + m.mlp_params + 2 * m.norm_params  # a 16384-wide MLP
    assert m.params == (24 * dense_block + 24 * m.moe_params_per_layer + m.embedding_params
                        + m.output_params)  # the output's count has the final norm
    mixed = Transformer(8, 64, 4, 32, 100, experts=4, top_k=1, dense_layers=2, moe_every=3)
    assert [moe_layers_of(mixed, 1, i) for i in range(8)] == [0, 0, 0, 0, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="moe_every must be an integer >= 1"):
        Transformer(8, 64, 4, 32, 100, experts=4, top_k=1, moe_every=0)
    with pytest.raises(ValueError, match="describe MoE layers"):
        Transformer(8, 64, 4, 32, 100, moe_every=2)
