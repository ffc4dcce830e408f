"""The transformer workload: exact parameter counts, FLOPs per token and per-layer GEMMs.

A decoder-only transformer is described by one frozen dataclass, ``Transformer``.  Two
families are covered exactly:

- GPT (GPT-2, GPT-3, Megatron-LM's GPT): learned position embeddings, LayerNorm with weight
  and bias, biases on every linear layer, a GeLU MLP of width ``ffn_hidden`` (4h), the output
  layer tied to the word embedding;
- LLaMA: rotary positions (no parameters), RMSNorm (weight only), no biases, a SwiGLU MLP
  (three matrices), grouped-query attention (``kv_heads`` < ``heads``), untied output layer.

A **mixture of experts** (Shazeer et al. 2017; Fedus et al. 2022) replaces the MLP of its MoE
layers by ``experts`` routed experts of width ``expert_ffn_hidden``, of which a router (a linear
layer ``h -> experts``) sends each token to ``top_k``, plus ``shared_experts`` that every token
goes through (DeepSeekMoE, Dai et al. 2024); the first ``dense_layers`` layers keep a dense MLP
of width ``ffn_hidden``.  ``params`` counts every expert, ``active_params`` the ones a token
uses; FLOPs count the active experts and the router.

FLOPs follow the convention of Narayanan et al. 2021 (Megatron-LM, SC21, Appendix) and
Chowdhery et al. 2022 (PaLM, Appendix B): only matrix multiplications count, a (m x k) @
(k x n) product costs 2mnk FLOPs, attention scores and the attention-weighted values count
the full s x s matrix (no causal halving), and the backward pass costs twice the forward
(one GEMM for the input gradient and one for the weight gradient).  For GPT this gives the
Megatron model FLOPs per token ``72 l h^2 (1 + s/(6h) + V/(12 l h))``, of which a third is the
forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from labsim.gemm import Gemm
from labsim.moe import check_experts, moe_layers_of

POSITIONS = ("learned", "rotary")
NORMS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer (sizes as in the papers' tables).

    ``layers`` l, ``hidden`` h, ``heads`` a, ``seq_len`` s (training context), ``vocab`` V,
    ``ffn_hidden`` (default 4h), ``kv_heads`` (grouped-query attention; default ``heads``),
    ``swiglu`` (three-matrix gated MLP), ``tied_embeddings`` (output layer shares the word
    embedding), ``positions`` ("learned": an s x h table as in GPT; "rotary": none),
    ``norm`` ("layernorm": weight + bias; "rmsnorm": weight only), ``bias`` (biases on the
    linear layers), ``dropout`` (trained with dropout, whose masks are kept for backward: GPT
    and Megatron yes, LLaMA no).

    Mixture of experts (module doc): ``experts`` routed experts per MoE layer (0: a dense
    model), ``top_k`` of them per token, ``expert_ffn_hidden`` their width (default
    ``ffn_hidden``), ``shared_experts`` always-on experts of width ``shared_ffn_hidden``
    (default ``expert_ffn_hidden``), ``dense_layers`` leading layers with a dense MLP of width
    ``ffn_hidden`` (DeepSeek's ``first_k_dense_replace``), then an MoE layer every
    ``moe_every`` layers, dense ones between (``labsim.moe``; Llama 4 Maverick: 2).
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    swiglu: bool = False
    tied_embeddings: bool = False
    positions: str = "learned"
    norm: str = "layernorm"
    bias: bool = True
    dropout: bool = True
    name: str = "custom"
    experts: int = 0
    top_k: int = 0
    expert_ffn_hidden: int | None = None
    shared_experts: int = 0
    shared_ffn_hidden: int | None = None
    dense_layers: int = 0
    moe_every: int = 1

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 1:
            raise ValueError(f"ffn_hidden must be a positive integer, got {self.ffn_hidden!r}")
        if not isinstance(self.kv_heads, int) or self.kv_heads < 1:
            raise ValueError(f"kv_heads must be a positive integer, got {self.kv_heads!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}; choose heads "
                "that divide hidden (head_dim = hidden / heads)"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads={self.kv_heads} does not divide heads={self.heads}; grouped-query "
                "attention needs heads to be a multiple of kv_heads"
            )
        check_experts(self)
        if self.positions not in POSITIONS:
            raise ValueError(f"positions={self.positions!r}; use one of {POSITIONS}")
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r}; use one of {NORMS}")

    # ----------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: object) -> Transformer:
        """A published configuration by name (case-insensitive); ``overrides`` replace fields,
        e.g. ``Transformer.preset("gpt2-124m", seq_len=256)``."""
        try:
            model = PRESETS[name.lower()]
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; presets: {', '.join(PRESETS)}"
            ) from None
        return replace(model, **overrides) if overrides else model

    @staticmethod
    def presets(dense: bool = False) -> tuple[str, ...]:
        """Names accepted by ``Transformer.preset``; ``dense``: only the models without
        mixture-of-experts layers (what the dense-only widgets offer)."""
        return tuple(n for n, m in PRESETS.items() if not (dense and m.experts))

    # ----------------------------------------------------------------- shapes
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        """2 for a GeLU MLP (up, down), 3 for SwiGLU (gate, up, down)."""
        return 3 if self.swiglu else 2

    # ----------------------------------------------------------------- parameters
    @property
    def norm_params(self) -> int:
        """Parameters of one normalisation layer (LayerNorm: 2h; RMSNorm: h)."""
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    @property
    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        weights = h * (h + 2 * kv) + h * h  # QKV projection, output projection
        biases = (h + 2 * kv) + h if self.bias else 0
        return weights + biases

    def _mlp_params(self, width: int) -> int:
        h, f = self.hidden, width
        weights = self.mlp_matrices * h * f
        biases = ((self.mlp_matrices - 1) * f + h) if self.bias else 0
        return weights + biases

    @property
    def mlp_params(self) -> int:
        """The dense MLP (of a dense model, or of an MoE model's ``dense_layers``)."""
        return self._mlp_params(self.ffn_hidden)

    @property
    def params_per_layer(self) -> int:
        """One dense transformer block: attention + MLP + two norms (GPT: 12h^2 + 13h)."""
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    # ----------------------------------------------------------------- mixture of experts
    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return moe_layers_of(self, self.layers)

    @property
    def expert_params(self) -> int:
        """One routed expert (an MLP of width ``expert_ffn_hidden``)."""
        return self._mlp_params(self.expert_ffn_hidden) if self.experts else 0

    @property
    def router_params(self) -> int:
        """The router of one MoE layer: a linear layer h -> experts, no bias."""
        return self.hidden * self.experts

    @property
    def moe_params_per_layer(self) -> int:
        """One MoE block: attention, every routed and shared expert, the router, two norms
        (0 for a dense model)."""
        if not self.experts:
            return 0
        shared = self.shared_experts * self._mlp_params(self.shared_ffn_hidden)
        return (self.attention_params + self.experts * self.expert_params + shared
                + self.router_params + 2 * self.norm_params)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: ``params`` with only ``top_k`` routed experts per MoE
        layer (Mixtral 8x7B: 12.9B of 46.7B; ``params`` for a dense model)."""
        idle = self.moe_layers * (self.experts - self.top_k) * self.expert_params
        return self.params - idle

    @property
    def embedding_params(self) -> int:
        """Word embedding plus learned position embedding (if any)."""
        positional = self.seq_len * self.hidden if self.positions == "learned" else 0
        return self.vocab * self.hidden + positional

    @property
    def output_params(self) -> int:
        """Final norm plus the output (LM head) matrix unless tied to the embedding."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.norm_params + head

    @property
    def params(self) -> int:
        """Exact number of parameters, embeddings included (tied weights counted once)."""
        return self.block_params + self.embedding_params + self.output_params

    @property
    def block_params(self) -> int:
        """Every transformer block: dense ones and MoE ones."""
        return ((self.layers - self.moe_layers) * self.params_per_layer
                + self.moe_layers * self.moe_params_per_layer)

    @property
    def non_embedding_params(self) -> int:
        """Parameters in the transformer blocks and final norm (Kaplan et al.'s N)."""
        return self.block_params + self.norm_params

    # ----------------------------------------------------------------- GEMMs and FLOPs
    def layer_gemms(
        self, micro_batch: int = 1, tp: int = 1, seq_len: int | None = None
    ) -> tuple[Gemm, ...]:
        """The matmuls of one transformer layer's forward pass on one tensor-parallel rank.

        Activations are ``(micro_batch * seq_len) x hidden``.  Megatron's split: QKV and the
        MLP's first matrices column-parallel (n / tp), the output projection and the MLP's
        last matrix row-parallel (k / tp), attention heads split over ranks.  The attention
        core appears as two batched GEMMs over ``micro_batch * heads / tp`` heads: scores
        ``Q K^T`` (s x d) @ (d x s) and values ``P V`` (s x s) @ (s x d).
        """
        b, s = _positive("micro_batch", micro_batch), _positive(
            "seq_len", self.seq_len if seq_len is None else seq_len
        )
        self.check_tp(tp)
        tokens, h, f, d = b * s, self.hidden, self.ffn_hidden, self.head_dim
        q_heads = self.heads // tp
        kv_heads = max(1, self.kv_heads // tp)
        gemms = [
            Gemm("qkv", tokens, (q_heads + 2 * kv_heads) * d, h),
            Gemm("attn_scores", s, s, d, batch=b * q_heads),
            Gemm("attn_values", s, d, s, batch=b * q_heads),
            Gemm("attn_out", tokens, h, q_heads * d),
        ]
        if self.swiglu:
            gemms.append(Gemm("mlp_gate_up", tokens, 2 * f // tp, h))
        else:
            gemms.append(Gemm("mlp_up", tokens, f // tp, h))
        gemms.append(Gemm("mlp_down", tokens, h, f // tp))
        return tuple(gemms)

    def moe_layer_gemms(self, micro_batch: int = 1, seq_len: int | None = None
                        ) -> tuple[Gemm, ...]:
        """The matmuls of one MoE layer's forward pass on one GPU holding every expert, with
        the tokens spread evenly over the experts: the attention of ``layer_gemms``, the router
        (``tokens x h -> experts``), each routed expert's MLP as a batch of ``experts`` GEMMs of
        ``tokens x top_k / experts`` rows (a grouped GEMM), and the shared experts' MLP over
        every token.  Empty for a dense model."""
        if not self.experts:
            return ()
        b, s = _positive("micro_batch", micro_batch), _positive(
            "seq_len", self.seq_len if seq_len is None else seq_len)
        tokens, h, e = b * s, self.hidden, self.experts
        attention = [g for g in self.layer_gemms(b, 1, s) if not g.name.startswith("mlp_")]
        per_expert = tokens * self.top_k / e
        rows = round(per_expert) if per_expert >= 1 else 1
        gemms = [*attention, Gemm("router", tokens, e, h)]
        for prefix, m, width, batch in (("expert", rows, self.expert_ffn_hidden, e),
                                        ("shared", tokens, self.shared_ffn_hidden,
                                         self.shared_experts)):
            if not batch:
                continue
            up = 2 * width if self.swiglu else width
            gemms += [Gemm(f"{prefix}_up", m, up, h, batch=batch),
                      Gemm(f"{prefix}_down", m, h, width, batch=batch)]
        return tuple(gemms)

    def layer_gemms_backward(
        self, micro_batch: int = 1, tp: int = 1, seq_len: int | None = None
    ) -> tuple[Gemm, ...]:
        """The backward GEMMs of one layer on one rank: for each forward ``C = A @ B`` with
        A (m x k), B (k x n), the input gradient ``dA = dC @ B^T`` (m x n)@(n x k) and the
        weight (or second-operand) gradient ``dB = A^T @ dC`` (k x m)@(m x n): twice the
        forward FLOPs."""
        grads = []
        for g in self.layer_gemms(micro_batch, tp, seq_len):
            grads.append(Gemm(f"{g.name}.dgrad", g.m, g.k, g.n, g.batch))
            grads.append(Gemm(f"{g.name}.wgrad", g.k, g.n, g.m, g.batch))
        return tuple(grads)

    def head_gemm(self, micro_batch: int = 1, tp: int = 1, seq_len: int | None = None) -> Gemm:
        """The output layer (logits) on one rank: vocabulary split over ``tp`` ranks."""
        s = self.seq_len if seq_len is None else seq_len
        self.check_tp(tp)
        return Gemm("lm_head", _positive("micro_batch", micro_batch) * s, -(-self.vocab // tp),
                    self.hidden)

    def attention_core_flops(self, micro_batch: int = 1, tp: int = 1) -> int:
        """Forward FLOPs of the s x s attention core of one layer on one rank (4 b s^2 h/tp)."""
        return sum(g.flops for g in self.layer_gemms(micro_batch, tp)
                   if g.name.startswith("attn_") and g.name != "attn_out")

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless ``tp`` splits heads, kv heads and the MLP evenly."""
        _positive("tp", tp)
        if self.heads % tp:
            raise ValueError(f"tp={tp} does not divide heads={self.heads}; pick tp | heads")
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ValueError(
                f"tp={tp} and kv_heads={self.kv_heads}: one must divide the other"
            )
        if self.ffn_hidden % tp:
            raise ValueError(f"tp={tp} does not divide ffn_hidden={self.ffn_hidden}")

    @property
    def flops_forward_per_token(self) -> float:
        """Model FLOPs of one token's forward pass at context ``seq_len`` (all layers + head)."""
        return (self._block_flops_forward() + self.head_gemm(1, 1).flops) / self.seq_len

    def _block_flops_forward(self) -> float:
        """Forward FLOPs of every block for one sequence: dense layers and MoE layers (their
        routed experts at ``top_k`` per token, exactly: ``2 top_k s`` rows of expert work)."""
        dense = sum(g.flops for g in self.layer_gemms(1, 1))
        if not self.experts:
            return self.layers * dense
        s, h = self.seq_len, self.hidden
        moe = sum(g.flops for g in self.moe_layer_gemms(1) if not g.name.startswith("expert_"))
        f = self.expert_ffn_hidden
        moe += 2 * s * self.top_k * h * f * self.mlp_matrices  # the routed experts, exactly
        return (self.layers - self.moe_layers) * dense + self.moe_layers * moe

    @property
    def flops_backward_per_token(self) -> float:
        """Backward pass = 2 x forward (input-gradient GEMM + weight-gradient GEMM)."""
        return 2 * self.flops_forward_per_token

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token without recomputation: forward + backward = 3 x forward.
        For large models about ``6 * params`` (Kaplan et al. 2020)."""
        return 3 * self.flops_forward_per_token

    def training_flops(self, tokens: float, recompute: str = "none") -> float:
        """FLOPs to train on ``tokens`` tokens. ``recompute="full"`` adds one more forward of
        every layer, not of the output layer (hardware FLOPs: Megatron's 96 l h^2 (1 + s/(6h)
        + V/(16lh)) instead of 72 l h^2 (1 + s/(6h) + V/(12lh)))."""
        if recompute not in ("none", "full"):
            raise ValueError(f"recompute={recompute!r}; use 'none' or 'full'")
        extra = 0.0
        if recompute == "full":
            extra = self._block_flops_forward() / self.seq_len
        return tokens * (self.flops_per_token + extra)

    def megatron_params(self) -> float:
        """Narayanan et al. 2021 eq. (GPT, tied, learned positions): 12lh^2(1 + 13/(12h) +
        (V+s)/(12lh)).  Equal to ``params`` minus the final LayerNorm's 2h for GPT configs."""
        n_layers, h = self.layers, self.hidden
        return (12 * n_layers * h**2
                * (1 + 13 / (12 * h) + (self.vocab + self.seq_len) / (12 * n_layers * h)))

    def __repr__(self) -> str:
        moe = (f", {self.experts} experts top-{self.top_k}"
               f"{f' + {self.shared_experts} shared' if self.shared_experts else ''} of "
               f"{self.expert_ffn_hidden}, {self.active_params / 1e9:.3g}B active"
               if self.experts else "")
        return (
            f"Transformer({self.name}: {self.params / 1e9:.3g}B params, l={self.layers}, "
            f"h={self.hidden}, a={self.heads}, kv={self.kv_heads}, s={self.seq_len}, "
            f"V={self.vocab}, ffn={self.ffn_hidden}{', swiglu' if self.swiglu else ''}"
            f"{', tied' if self.tied_embeddings else ''}{moe})"
        )


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _gpt(name: str, layers: int, hidden: int, heads: int, seq_len: int, vocab: int) -> Transformer:
    return Transformer(layers, hidden, heads, seq_len, vocab, tied_embeddings=True, name=name)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, seq_len: int,
           kv_heads: int | None = None) -> Transformer:
    return Transformer(layers, hidden, heads, seq_len, 32000, ffn_hidden=ffn, kv_heads=kv_heads,
                       swiglu=True, positions="rotary", norm="rmsnorm", bias=False,
                       dropout=False, name=name)


_PRESETS = (
    # GPT-2 small (Radford et al. 2019; HF config n_layer 12, n_embd 768, n_head 12,
    # n_positions 1024, vocab 50257): 124,439,808 params.
    _gpt("gpt2-124m", 12, 768, 12, 1024, 50257),
    _gpt("gpt2-350m", 24, 1024, 16, 1024, 50257),  # GPT-2 medium (HF config)
    _gpt("gpt2-774m", 36, 1280, 20, 1024, 50257),  # GPT-2 large (HF config)
    _gpt("gpt2-1.5b", 48, 1600, 25, 1024, 50257),  # GPT-2 XL (HF config)
    # GPT-3 (Brown et al. 2020, Table 2.1): "175B" is 174.6e9 with this exact count.
    _gpt("gpt3-175b", 96, 12288, 96, 2048, 50257),
    # LLaMA (Touvron et al. 2023a, Table 2): same shapes as LLaMA-2 7B, context 2048.
    _llama("llama-7b", 32, 4096, 32, 11008, 2048),
    # LLaMA 2 (Touvron et al. 2023b; HF configs): 7B = 6,738,415,616 params.
    _llama("llama2-7b", 32, 4096, 32, 11008, 4096),
    _llama("llama2-13b", 40, 5120, 40, 13824, 4096),
    _llama("llama2-70b", 80, 8192, 64, 28672, 4096, kv_heads=8),
    # Megatron-LM GPT family (Narayanan et al. 2021, Table 1): V = 51200, s = 2048.
    _gpt("megatron-1.7b", 24, 2304, 24, 2048, 51200),
    _gpt("megatron-3.6b", 30, 3072, 32, 2048, 51200),
    _gpt("megatron-7.5b", 36, 4096, 32, 2048, 51200),
    _gpt("megatron-18.4b", 40, 6144, 48, 2048, 51200),
    _gpt("megatron-39.1b", 48, 8192, 64, 2048, 51200),
    _gpt("megatron-76.1b", 60, 10240, 80, 2048, 51200),
    _gpt("megatron-145.6b", 80, 12288, 96, 2048, 51200),
    _gpt("megatron-310.1b", 96, 16384, 128, 2048, 51200),
    _gpt("megatron-529.6b", 105, 20480, 128, 2048, 51200),
    _gpt("megatron-1t", 128, 25600, 160, 2048, 51200),
)
_MOE_PRESETS = (
    # Mixtral 8x7B (Jiang et al. 2024, arXiv:2401.04088, Table 1: dim 4096, 32 layers, head dim
    # 128, hidden_dim 14336, 32 heads, 8 kv heads, vocab 32000, 8 experts, top-2 experts;
    # "47B parameters, but only uses 13B active parameters"): 46.7B, 12.9B active.
    replace(_llama("mixtral-8x7b", 32, 4096, 32, 14336, 32768, kv_heads=8), experts=8,
            top_k=2),
    # Mixtral 8x22B (Mistral AI, April 2024, "141B parameters ... 39B active"; HF config
    # mistralai/Mixtral-8x22B-v0.1: hidden 6144, intermediate 16384, 56 layers, 48 heads, 8 kv
    # heads, vocab 32768, context 65536, 8 local experts, 2 per token).
    replace(_llama("mixtral-8x22b", 56, 6144, 48, 16384, 65536, kv_heads=8), vocab=32768,
            experts=8, top_k=2),
    # DeepSeekMoE 16B (Dai et al. 2024, arXiv:2401.06066, sec. 5; HF config
    # deepseek-ai/deepseek-moe-16b-base: 28 layers, hidden 2048, 16 heads, first layer dense with
    # intermediate 10944, then 64 routed experts of 1408 and 2 shared, 6 per token, vocab 102400,
    # context 4096): 16.4B, 2.8B active.
    replace(_llama("deepseek-moe-16b", 28, 2048, 16, 10944, 4096), vocab=102400, experts=64,
            top_k=6, expert_ffn_hidden=1408, shared_experts=2, dense_layers=1),
    # Qwen1.5-MoE-A2.7B (Qwen team, March 2024; HF config Qwen/Qwen1.5-MoE-A2.7B, qwen2_moe:
    # hidden 2048, 24 layers, 16 heads, 60 experts of 1408, 4 per token, one shared expert of
    # 5632, vocab 151936, untied): "14.3B parameters in total and 2.7B activated".  Not counted:
    # the q/k/v biases and the shared expert's one-output gate (3h + h a layer, 0.001 %).
    replace(_llama("qwen1.5-moe-a2.7b", 24, 2048, 16, 5632, 8192), vocab=151936, experts=60,
            top_k=4, expert_ffn_hidden=1408, shared_experts=1, shared_ffn_hidden=5632),
    # Qwen2-57B-A14B (Yang et al. 2024, arXiv:2407.10671: 57B, 14B activated; HF config
    # Qwen/Qwen2-57B-A14B: hidden 3584, 28 layers, 28 heads, 4 kv heads, 64 experts of 2560, 8
    # per token, a shared expert of 20480, vocab 151936; context 32768 as the paper's last
    # pre-training stage): the same biases and gate left out.
    replace(_llama("qwen2-57b-a14b", 28, 3584, 28, 18944, 32768, kv_heads=4), vocab=151936,
            experts=64, top_k=8, expert_ffn_hidden=2560, shared_experts=1,
            shared_ffn_hidden=20480),
    # Llama 4 Scout (Meta, April 2025; HF config meta-llama/Llama-4-Scout-17B-16E text_config:
    # hidden 5120, 48 layers all MoE, 40 heads, 8 kv heads, 16 experts of 8192, 1 per token,
    # vocab 202048; transformers' Llama4TextMoe adds one shared expert of 8192): "17B active,
    # 109B total" with the vision encoder; the text model is 107.8B.  Its chunked attention
    # (8192-token chunks on three layers of four) equals full attention up to 8192 tokens.
    replace(_llama("llama4-scout-17b-16e", 48, 5120, 40, 8192, 8192, kv_heads=8),
            vocab=202048, experts=16, top_k=1, shared_experts=1),
    # Llama 4 Maverick (Meta, April 2025; HF config meta-llama/Llama-4-Maverick-17B-128E
    # text_config: Scout's shapes with 128 experts, interleave_moe_layer_step 2, dense layers of
    # intermediate_size_mlp 16384): "17B active, 400B total" (with the vision encoder).
    replace(_llama("llama4-maverick-17b-128e", 48, 5120, 40, 16384, 8192, kv_heads=8),
            vocab=202048, experts=128, top_k=1, expert_ffn_hidden=8192, shared_experts=1,
            moe_every=2),
)
PRESETS = MappingProxyType({m.name: m for m in _PRESETS + _MOE_PRESETS})
