"""Where training memory goes: model states (weights, gradients, optimizer) and activations.

Model states per parameter come from the precision (``labsim.precision.PRECISIONS``: the one
table of weights, gradients, fp32 master copy and optimizer-state bytes by precision name):
``"fp32"`` 4 + 4 + 8 = 16 B with Adam; ``"mixed"`` / ``"bf16"`` / ``"fp16"`` 2 + 2 + (4 + 4 + 4)
= 16 B; ``"mixed-fp32-grads"`` 18 B; ``"autocast-*"`` (torch.amp) 4 + 4 + 8 = 16 B;
``"pure-bf16"`` / ``"pure-fp16"`` 2 + 2 + 4 = 8 B.

"mixed" is Rajbhandari et al. 2020 (ZeRO, Sec. 3.1): (2 + 2 + K) Psi with K = 12.  Megatron-LM
keeps gradients in fp32 (its distributed-optimizer notes count 18 bytes/param).  SGD keeps
no state (mixed still keeps the fp32 master copy, 4 B); SGD with momentum keeps one buffer.

ZeRO (stages 1/2/3) shards optimizer states / + gradients / + weights over the ``dp``
data-parallel ranks; the ZeRO paper's 7.5B example on 64 GPUs gives 120 / 31.4 / 16.6 / 1.9 GB.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), Table 2, per layer with 16-bit values and 1-byte dropout masks:

- no parallelism: ``sbh (34 + 5as/h)``
- tensor parallel t: ``sbh (10 + 24/t + 5as/(ht))``
- tensor + sequence parallel: ``sbh (34/t + 5as/(ht))``
- selective recompute drops the ``5as/(ht)`` term (the s x s attention activations)
- full recompute: ``2sbh`` (each layer keeps its input only)

Without dropout the s x s term is ``2as^2b`` (the softmax output, kept once), a SwiGLU MLP
keeps four f-wide tensors instead of two, and FlashAttention keeps an fp32 log-sum-exp per
head and token instead of the s x s tensors (``activation_per_layer``).

``"op-sac"`` is torchtitan's op-level selective activation checkpointing
(``labsim.op_sac.op_sac_per_layer``): each block keeps its input, the outputs of every other
``aten.mm`` and of the SDPA kernel, and recomputes the rest in backward.

Under 1F1B the first of p pipeline stages holds p micro-batches of L/p layers = L layers'
worth; interleaving with v virtual stages multiplies by ``1 + (p-1)/(p v)`` (Sec. 4.2.3).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from labsim.context_parallel import local_model
from labsim.expert_parallel import (
    check_imbalance,
    check_moe_layer,
    mlp_shard_params,
    routed_expert_params,
)
from labsim.loss import loss_memory
from labsim.moe import moe_layers_of
from labsim.op_sac import op_sac_per_layer
from labsim.pipeline import in_flight_peak
from labsim.precision import PRECISIONS as PRECISION_TABLE
from labsim.precision import Precision, training_precision
from labsim.units import fmt_bytes
from labsim.workload import Transformer

PRECISIONS = tuple(PRECISION_TABLE)
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")
RECOMPUTE = ("none", "selective", "full", "op-sac")
ATTENTION = ("standard", "flash")

_STATES = {"adam": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU: ``params`` (weights), ``grads``, ``optimizer`` (master copy + states),
    ``activations``.  ``model_states`` = the first three, ``total`` = all four."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def as_dict(self) -> dict[str, float]:
        """The four parts in order, for tables and stacked bars."""
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }

    def fits(self, capacity_bytes: float) -> bool:
        """True if ``total`` fits in ``capacity_bytes`` (e.g. ``labsim.gpu('A100-80GB')
        .memory_bytes``); allocator fragmentation and workspace are not modelled."""
        return self.total <= capacity_bytes

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={fmt_bytes(v)}" for k, v in self.as_dict().items())
        return f"MemoryBreakdown({parts}; total={fmt_bytes(self.total)})"


def bytes_per_param(precision: str | Precision = "mixed",
                    optimizer: str = "adam") -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter before any sharding."""
    prec = training_precision(precision)
    if optimizer not in _STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {OPTIMIZERS}")
    return (prec.weight_bytes, prec.grad_bytes,
            prec.master_bytes + _STATES[optimizer] * prec.state_bytes)


def training_memory(
    params_or_model: int | float | Transformer,
    *,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    zero_stage: int = 0,
    dp: int = 1,
    **activation_kwargs: Any,
) -> MemoryBreakdown:
    """Bytes per GPU of training a model with ``dp``-way data parallelism and ZeRO.

    ``params_or_model``: a parameter count, or a ``Transformer``.  With a Transformer and
    ``micro_batch=...`` (plus any other ``activation_memory`` keyword: recompute, ...) the
    activations are included; with ``tp``/``pp`` > 1 the model states are those of one rank of
    the first pipeline stage (``stage_params``).  Activations are stored in the precision's
    compute dtype (``Precision.activation_bytes``: 4 bytes for fp32, else 2).
    """
    prec = training_precision(precision)
    if optimizer not in _STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {OPTIMIZERS}")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}; ZeRO has stages 0, 1, 2 and 3")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be a positive integer (data-parallel ranks), got {dp!r}")

    activations = 0.0
    if isinstance(params_or_model, Transformer):
        model = params_or_model
        tp, pp = activation_kwargs.get("tp", 1), activation_kwargs.get("pp", 1)
        n = float(stage_params(model, tp=tp, pp=pp))
        if "micro_batch" in activation_kwargs:
            activation_kwargs.setdefault("dtype_bytes", prec.activation_bytes)
            activations = activation_memory(model, **activation_kwargs)
        elif set(activation_kwargs) - {"tp", "pp"}:
            raise ValueError(
                f"{sorted(set(activation_kwargs) - {'tp', 'pp'})} describe activations: add "
                "micro_batch=... (sequences per step)"
            )
    else:
        if activation_kwargs:
            raise ValueError(
                f"activation keywords {sorted(activation_kwargs)} need a Transformer, not a "
                "parameter count: pass labsim.Transformer(...) or a preset"
            )
        if isinstance(params_or_model, bool) or not isinstance(params_or_model, numbers.Real):
            raise ValueError(
                f"params_or_model must be a parameter count (a number, e.g. 7e9) or a "
                f"Transformer, got {type(params_or_model).__name__} {params_or_model!r}"
            )
        n = float(params_or_model)
        if not math.isfinite(n) or n < 0:
            raise ValueError(f"parameter count must be a finite number >= 0, got "
                             f"{params_or_model!r}")

    w, g, o = bytes_per_param(precision, optimizer)
    # ZeRO (Rajbhandari et al. 2020, Fig. 1): P_os shards optimizer states, P_os+g also the
    # gradients, P_os+g+p also the weights, each over the dp ranks.
    shard_o = dp if zero_stage >= 1 else 1
    shard_g = dp if zero_stage >= 2 else 1
    shard_w = dp if zero_stage >= 3 else 1
    return MemoryBreakdown(
        params=w * n / shard_w,
        grads=g * n / shard_g,
        optimizer=o * n / shard_o,
        activations=activations,
    )


def stage_params(model: Transformer, *, tp: int = 1, pp: int = 1, stage: int = 0,
                 layers: int | None = None, first_layer: int | None = None,
                 ep: int = 1, etp: int | None = None) -> int:
    """Parameters held by one tensor-parallel rank of pipeline stage ``stage``.

    Layers split evenly over ``pp`` stages (or ``layers`` of them on this stage, as
    ``Plan.chunk_layers`` gives when the embedding and the loss count as layers); the first
    stage also holds the embeddings, the last the final norm and output layer (with tied
    embeddings Megatron keeps a copy of the word embedding there).  Under tensor parallelism
    (Shoeybi et al. 2019) the QKV, output projection, MLP matrices, column-parallel biases and
    the vocabulary are split over ``tp``; norms, row-parallel biases and position embeddings
    are replicated.  A mixture-of-experts model's MoE layers hold ``experts / ep`` experts
    (``labsim.expert_parallel``), each split over ``etp`` (default ``tp``), and the router
    whole; its leading dense layers are those of the stage's layers from ``first_layer``
    (default: ``stage`` times the even share) that come before ``dense_layers``.
    """
    model.check_tp(tp)
    if not isinstance(pp, int) or pp < 1 or (layers is None and model.layers % pp):
        raise ValueError(f"pp={pp!r} must be a positive divisor of layers={model.layers}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)
                               or not 0 <= layers <= model.layers):
        raise ValueError(f"layers={layers!r} must be a whole number in 0..{model.layers}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in 0..{pp - 1}")
    h, f, kv, m = model.hidden, model.ffn_hidden, model.kv_dim, model.mlp_matrices
    kv_shard = kv // tp if model.kv_heads % tp == 0 else model.head_dim
    q_shard = h // tp
    sharded = h * (q_shard + 2 * kv_shard) + q_shard * h + m * h * (f // tp)
    if model.bias:
        sharded += (q_shard + 2 * kv_shard) + (m - 1) * (f // tp)
        replicated_bias = 2 * h  # attention output and MLP down biases (row-parallel)
    else:
        replicated_bias = 0
    per_layer = sharded + replicated_bias + 2 * model.norm_params
    n = model.layers // pp if layers is None else layers
    total = n * per_layer
    if model.experts:  # the stage's MoE layers: their MLP is the experts and the router
        first = stage * (model.layers // pp) if first_layer is None else first_layer
        experts = (routed_expert_params(model, tp if etp is None else etp, ep)
                   + model.router_params
                   + model.shared_experts * mlp_shard_params(model, model.shared_ffn_hidden, tp))
        total += moe_layers_of(model, n, first) * (experts - mlp_shard_params(model, f, tp))
    vocab_shard = -(-model.vocab // tp) * h
    if stage == 0:
        total += vocab_shard
        if model.positions == "learned":
            total += model.seq_len * h
    if stage == pp - 1:
        total += model.norm_params
        if not model.tied_embeddings or pp > 1:
            total += vocab_shard
    return total


def activation_per_layer(
    model: Transformer,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype_bytes: float = 2,
    mask_bytes: float | None = None,
    attention: str = "standard",
    swiglu_fused: bool = False,
    moe: bool | None = None,
    expert_imbalance: float = 1.0,
) -> float:
    """Activation bytes one layer keeps for backward (Korthikanti et al. 2022, Table 2).

    With ``dtype_bytes=2`` (16-bit values) and ``mask_bytes=1`` (CUDA's byte dropout masks)
    the GPT layer of the paper (4h GeLU MLP, dropout) is Table 2 exactly.  In general, with
    d = ``dtype_bytes`` and m = ``mask_bytes``, ``34 sbh -> sbh(16d + 2m)`` and
    ``5as^2b -> as^2b(2d + m)`` (three dropout masks: two of sbh, one of as^2b).

    A model trained without dropout (``model.dropout`` False) keeps no masks, and its
    attention keeps the softmax output once: the dropout output *is* the softmax output, so
    the s x s term is ``d as^2b``, not ``2d as^2b``.  ``mask_bytes=None`` means 1 with
    dropout; PyTorch's CPU dropout keeps its mask in the input's dtype (m = d).

    A SwiGLU MLP, ``down(silu(gate) * up)``, keeps four tensors of width f: gate and up (the
    first matrix's outputs), silu(gate) and the product (the two factors of the multiply and
    the input of ``down``); a GeLU MLP keeps two (the first matrix's output and the GeLU's).
    Grouped-query attention keeps narrower K and V.

    ``attention="flash"`` (FlashAttention, Dao et al. 2022) keeps no s x s tensor: its
    backward recomputes the probabilities from the fp32 per-row log-sum-exp, 4 bytes per
    head and token (``as b``), and regenerates the dropout mask from the RNG state.
    Measured against ``labsim.lab.MemoryMeter`` in tests/test_lab_models.py.

    ``recompute="op-sac"``: torchtitan's op-level selective checkpointing,
    ``op_sac_per_layer`` (its masks are regenerated, none kept).

    ``moe``: for a mixture-of-experts model, an MoE layer (True) or a leading dense one
    (False).  An MoE layer keeps, instead of the MLP's tensors, each routed token's copy
    (``top_k`` h-wide rows: the experts' inputs) and its expert's f-wide tensors, the shared
    experts' tensors over every token, and the router's fp32 scores (``experts`` per token);
    the tokens spread evenly over the experts, or on the busiest expert-parallel rank
    ``expert_imbalance`` times the mean (``labsim.expert_parallel``).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; use one of {RECOMPUTE}")
    check_moe_layer(model, moe)
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}; use one of {ATTENTION}")
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    if mask_bytes is None:
        mask_bytes = 1 if model.dropout else 0
    if not dtype_bytes > 0 or not mask_bytes >= 0:
        raise ValueError(
            f"dtype_bytes must be > 0 and mask_bytes >= 0, got {dtype_bytes!r}, {mask_bytes!r}"
        )
    if mask_bytes and not model.dropout:
        raise ValueError(
            f"mask_bytes={mask_bytes!r} for a model trained without dropout: it keeps no "
            "masks; build the Transformer with dropout=True or pass mask_bytes=0"
        )
    model.check_tp(tp)
    if sequence_parallel and tp == 1:
        sequence_parallel = False  # identical to no parallelism
    s, b, h, a, t = model.seq_len, micro_batch, model.hidden, model.heads, tp
    d, m = dtype_bytes, mask_bytes
    sbh = s * b * h
    if recompute == "op-sac":
        if moe:
            raise ValueError("recompute='op-sac' saves a dense block's matmuls; use "
                             "'selective' or 'full' for an MoE layer")
        return op_sac_per_layer(model, micro_batch=b, tp=t,
                                sequence_parallel=sequence_parallel, dtype_bytes=d,
                                attention=attention)
    if recompute == "full":
        return d * sbh  # the layer's input only: 2sbh in 16 bits
    # Replicated part: LayerNorm inputs (2 x sbh), attention and MLP inputs (2 x sbh), the
    # two sbh dropout masks; split part: Q and K, V, projection input, and the MLP's f-wide
    # tensors (2 for GeLU, 4 for SwiGLU).  For the GPT layer of the paper (K, V as wide as
    # Q, a 4h GeLU MLP) the split part is 24 sbh.
    kv = model.kv_dim / h

    def widths(f: float) -> float:  # an MLP's f-wide tensors, in units of h
        return (3 if swiglu_fused else 4) * f if model.swiglu else 2 * f

    mlp, routed = widths(model.ffn_hidden / h), 0.0
    if moe:  # the f-wide tensors split over tp; the routed copies and scores on every rank
        k = model.top_k * check_imbalance(expert_imbalance)
        mlp = (k * widths(model.expert_ffn_hidden / h)
               + model.shared_experts * widths(model.shared_ffn_hidden / h))
        routed = d * k + 4 * model.experts / h
    replicated = 4 * d + 2 * m + routed  # 10 for d = 2, m = 1 (a dense layer)
    split = d * (2 + 2 * kv + mlp)  # 24 for d = 2, kv = 1, f = 4 (GeLU)
    linear = (replicated + split) / t if sequence_parallel else replicated + split / t
    if attention == "flash":
        scores = 4 * a / (h * t)  # fp32 log-sum-exp per head and token
    elif recompute == "selective":
        scores = 0.0
    else:
        per_score = 2 * d + m if model.dropout else d  # softmax out, mask, dropout out
        scores = per_score * a * s / (h * t)  # 5as/(ht) for d = 2, m = 1
    return sbh * (linear + scores)


def activation_memory(
    model: Transformer,
    *,
    micro_batch: int,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    virtual_stages: int = 1,
    dtype_bytes: float = 2,
    mask_bytes: float | None = None,
    attention: str = "standard",
) -> float:
    """Activation bytes held at peak by the FIRST pipeline stage under 1F1B.

    ``L * activation_per_layer * (1 + (p-1)/(p v))`` with the interleaving factor applying
    only when ``virtual_stages`` v > 1 (Korthikanti et al. 2022, Sec. 4.2.3; with v = 1 the
    first stage holds p micro-batches of L/p layers = L layers).  Embedding-dropout and
    output-layer buffers (a few sbh, Sec. 4.3) are not included.  A mixture-of-experts model
    counts each layer as its MoE layers (``activation_per_layer(moe=True)``) or its leading
    dense ones, whichever keeps more.
    """
    if not isinstance(pp, int) or pp < 1 or model.layers % pp:
        raise ValueError(f"pp={pp!r} must be a positive divisor of layers={model.layers}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if virtual_stages > 1 and model.layers % (pp * virtual_stages):
        raise ValueError(
            f"layers={model.layers} must be divisible by pp * virtual_stages = "
            f"{pp * virtual_stages} for the interleaved schedule"
        )
    per_layer = max(activation_per_layer(
        model, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel,
        recompute=recompute, dtype_bytes=dtype_bytes, mask_bytes=mask_bytes,
        attention=attention, moe=moe)
        for moe in ((True, False) if model.experts else (None,)))
    factor = 1 + (pp - 1) / (pp * virtual_stages) if virtual_stages > 1 else 1.0
    return model.layers * per_layer * factor


def zero_stages(
    params_or_model: int | float | Transformer,
    *,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    dp: int = 1,
    **activation_kwargs: Any,
) -> dict[str, MemoryBreakdown]:
    """``training_memory`` for ZeRO stages 0 to 3 at one setting: {"ZeRO-0": ..., ...}."""
    return {
        f"ZeRO-{stage}": training_memory(
            params_or_model, precision=precision, optimizer=optimizer, zero_stage=stage,
            dp=dp, **activation_kwargs,
        )
        for stage in range(4)
    }


def zero3_unit_params(model: Transformer, tp: int, unit: str) -> tuple[float, ...]:
    """Parameters on one GPU of each ZeRO-3 unit of a layer, in forward order: ``"layer"``
    (FSDP: the whole layer) or ``"tensor"`` (DeepSpeed 2021: its four weight tensors, QKV,
    output projection, MLP input, MLP output; biases and norms stay whole)."""
    if unit not in ("layer", "tensor"):
        raise ValueError(f"zero3 unit {unit!r}: choose 'layer' or 'tensor'")
    h, f = model.hidden, model.ffn_hidden
    if unit == "tensor":
        return (h * (h + 2 * model.kv_dim) / tp, h * h / tp,
                (model.mlp_matrices - 1) * h * f / tp, f * h / tp)
    return (model.params_per_layer / tp,)


def step_memory(model: Transformer, plan: object, in_flight: int, *,
                extra_grad_bytes_per_param: float = 0.0,
                swiglu_fused: bool = False, zero3_unit: str = "layer",
                cross_entropy: str = "eager") -> MemoryBreakdown:
    """Memory of the first pipeline stage's GPU in a training step under ``plan`` (a
    ``labsim.Plan``) whose schedule holds ``in_flight`` (micro-batch, model chunk) activations
    at its peak: its model-state shard (``training_memory`` with the plan's ZeRO stage) and
    the activations of ``in_flight`` chunks (``activation_per_layer``; with FlashAttention no
    s x s scores are kept).  Where the plan counts the embedding as a layer
    (``Plan.chunk_layers``), the first stage's chunks differ and its schedule is walked for
    the most layers' activations held at once.  With recomputation the layer being recomputed
    holds, for the length of its backward, what it would keep without (one layer of one
    micro-batch: ``activation_per_layer`` with ``recompute="none"`` less what is kept anyway),
    the transient that Korthikanti et al.'s per-layer count leaves out.  ZeRO-3 adds the
    units it has gathered in full (``zero3_unit``: a layer, or the largest weight tensor for
    DeepSpeed 2021's per-tensor gathers; ``zero3_unit_params``): the one computing, the one
    whose gradients are being reduced, and ``zero3_prefetch`` ahead.
    ``extra_grad_bytes_per_param``: a second gradient the software keeps beside the
    precision's for the whole step (a software profile's, ``labsim.software``), counted with
    the gradients.  ``swiglu_fused``: a SwiGLU MLP keeps three f-wide tensors, not four
    (``activation_per_layer``).

    On a single-stage pipeline (``pp == 1``) the first stage also computes the logits and the
    loss: ``loss_memory`` of the ``cross_entropy`` kernel at the start of backward, while
    every layer's activations are held; it and the recomputed layer's working set come one
    after the other, so the larger of the two counts.  Under ZeRO-3 with
    ``zero3_unit="layer"`` the root unit (the embedding, the final norm and the output
    layer: ``stage_params`` with no layers) stays whole from its forward to the end of
    backward (FSDP2 ``FSDPState._lazy_init``: "For the root, do not reshard after forward";
    FSDP1 ``_post_forward_reshard``: "Do not free the root's parameters in the post-forward").
    Not counted (tens of MiB against tens of GB): cuBLASLt's workspace, 32 MiB per handle and
    stream on Hopper, 4 MiB on Ampere (pytorch/pytorch#120925), NCCL's ``NCCL_BUFFSIZE``, 4 MiB
    per channel and peer, the CUDA context.  Context parallelism: activations and the loss of
    the rank's ``s / cp`` tokens (``labsim.context_parallel.local_model``), states sharded over
    ``dp * cp`` ranks (``Plan.gradient_ranks``).
    """
    prec = training_precision(plan.numerics)
    v = plan.virtual_stages
    chunks = plan.pp * v
    act = local_model(model, plan.cp)

    def layer_bytes(recompute: str) -> float:  # an MoE model: its larger kind of layer
        return max(activation_per_layer(
            act, micro_batch=plan.micro_batch, tp=plan.tp,
            sequence_parallel=plan.sequence_parallel, recompute=recompute,
            dtype_bytes=prec.activation_bytes, attention=plan.attention,
            swiglu_fused=swiglu_fused, moe=moe, expert_imbalance=plan.expert_load)
            for moe in ((True, False) if model.experts else (None,)))

    per_layer = layer_bytes(plan.recompute)
    split = plan.chunk_layers(model.layers)
    mine = split[0::plan.pp]  # the first stage's chunks, in its local order
    if len(set(mine)) == 1:
        held = mine[0] * in_flight
    else:  # the embedding counted as a layer: chunk 0 holds fewer; walk the schedule
        held = in_flight_peak(plan.schedule, plan.pp, plan.microbatches, v, mine,
                              group=plan.microbatch_group)
    activations = per_layer * held
    transient = 0.0
    if plan.recompute != "none":  # the recomputed layer's working set, one at a time
        transient = layer_bytes("none") - per_layer
    if plan.pp == 1:  # the first stage is the last: the logits and the loss, before the layers
        transient = max(transient, loss_memory(act, micro_batch=plan.micro_batch,
                                               tp=plan.tp, dtype_bytes=prec.activation_bytes,
                                               kernel=cross_entropy))
    activations += transient
    n = float(sum(stage_params(model, tp=plan.tp, pp=chunks, stage=g, layers=split[g],
                               first_layer=sum(split[:g]), ep=plan.ep, etp=plan.expert_tp)
                  for g in range(0, chunks, plan.pp)))
    # the routed experts' states shard over the expert-data-parallel group (Plan docs)
    routed = float(sum(moe_layers_of(model, split[g], sum(split[:g]))
                       for g in range(0, chunks, plan.pp))
                   * routed_expert_params(model, plan.expert_tp, plan.ep))
    states = training_memory(n - routed, precision=prec, optimizer=plan.optimizer,
                             zero_stage=plan.zero_stage, dp=plan.gradient_ranks)
    experts = training_memory(routed, precision=prec, optimizer=plan.optimizer,
                              zero_stage=plan.zero_stage, dp=plan.expert_data_ranks)
    params = states.params + experts.params
    if plan.zero_stage == 3 and plan.gradient_ranks > 1:
        unit = max(zero3_unit_params(model, plan.tp, zero3_unit))
        params += (plan.zero3_prefetch + 2) * unit * prec.weight_bytes
        if zero3_unit == "layer":  # FSDP's root unit: embedding, final norm, output layer
            root = stage_params(model, tp=plan.tp, pp=plan.pp, layers=0)
            params += root * prec.weight_bytes
    grads = states.grads + experts.grads + extra_grad_bytes_per_param * n
    return MemoryBreakdown(params, grads, states.optimizer + experts.optimizer, activations)
