"""Compute cost of a transformer layer on one GPU: GEMMs, attention, memory-bound kernels.

The closed-form face of the step simulator's compute (``labsim.sim.step`` executes these
times).  Every time is one kernel class on one GPU of a tensor-parallel group, for one
micro-batch of ``b`` sequences of ``s`` tokens:

* **GEMMs** (QKV, attention projection, the two or three MLP matrices, the logits) take
  ``max(FLOPs / (peak * eff(FLOPs)), bytes / (HBM * mem_eff))``: a roofline whose compute roof
  is the dense peak times an efficiency that grows with the GEMM's size (small GEMMs leave SMs
  idle in the last wave and cannot hide their loads), as in Calculon's system files (Isaev et
  al. 2023, ``systems/a100_80g.json``: efficiency vs GEMM GFLOP).  Backward runs two GEMMs of
  the same size per forward GEMM (data gradient and weight gradient).
* **Attention core** (``softmax(QK^T) V``): with ``attention="flash"`` one fused kernel at a
  published fraction of peak (causal: half the score blocks are skipped), of the kernel the
  software runs (``FLASH_KERNELS``: Dao's CUDA kernels, or the Triton kernel of 2022 that
  MosaicML's llm-foundry ran); with ``"standard"`` two batched GEMMs plus memory-bound
  softmax and dropout over the ``s x s`` scores, as Megatron-LM ran in 2021 (fused
  scale-mask-softmax kernel).
* **Memory-bound kernels** (layer norms, bias + dropout + residual, GeLU/SwiGLU, softmax,
  cross-entropy, the optimizer) take bytes moved / (HBM bandwidth * efficiency).

One set of constants per GPU type (``EFFICIENCY``), never per run; each carries its source.

A collective that runs beside compute on the same GPU slows that compute
(``overlap_extra_s``): NCCL's kernels hold SMs (one thread block per channel) and HBM
bandwidth while the GEMMs run.  Lee et al. 2025 (arXiv:2507.03114) measured the slowdown of
overlapped compute on A100, H100, MI250 and MI210 nodes running GPT and LLaMA layers: 18.9 %
on average, 40 % at most (``Efficiency.overlap_slowdown``).
"""

from __future__ import annotations

from dataclasses import dataclass

from labsim.context_parallel import local_model
from labsim.efficiency import (  # noqa: F401  (re-exported: labsim.compute's constants)
    EFFICIENCY,
    FLASH_KERNELS,
    GEMM_SHAPE,
    MEMORY_SHAPE,
    OVERLAP_SLOWDOWN,
    SUSTAINED_A100,
    SUSTAINED_H100,
    Efficiency,
    efficiency,
    log_curve,
)
from labsim.expert_parallel import check_imbalance, check_moe_layer, local_experts, routed_rows
from labsim.fp8 import cast_bytes, check_gpu, fused_input_bytes, gemm_slowdown
from labsim.hardware import GPU
from labsim.op_sac import op_sac_matmuls
from labsim.precision import Precision, training_precision
from labsim.workload import Transformer


def overlap_extra_s(compute_s: float, comm_s: float, slowdown: float) -> float:
    """Seconds a collective of ``comm_s`` adds to ``compute_s`` of compute it runs beside:
    compute during the overlap runs ``slowdown`` longer (a GPU's
    ``Efficiency.overlap_slowdown``, Lee et al. 2025), so a collective inside the compute adds
    ``comm_s * k / (1 + k)`` and compute inside a longer collective ``compute_s * k``."""
    if compute_s <= 0 or comm_s <= 0:
        return 0.0
    return min(comm_s * slowdown / (1 + slowdown), compute_s * slowdown)


def memory_time(nbytes: float, gpu: GPU, sustained: float | None = None) -> float:
    """Seconds for a memory-bound kernel moving ``nbytes`` through HBM; ``sustained``
    overrides the GPU's default sustained fraction (a software profile's)."""
    if nbytes <= 0:
        return 0.0
    s = efficiency(gpu).sustained if sustained is None else sustained
    eff = log_curve(MEMORY_SHAPE, nbytes / 1e6) * s
    return nbytes / (gpu.memory_bandwidth_Bps * eff)


def gemm_time(m: int, n: int, k: int, gpu: GPU, dtype: str = "bf16", batch: int = 1,
              bytes_per_element: int = 2, sustained: float | None = None) -> float:
    """Seconds for ``batch`` GEMMs (m x k) @ (k x n) on ``gpu``: compute roof at the size-
    dependent efficiency, or memory roof (read A and B, write C), whichever is slower."""
    flops = 2.0 * m * n * k * batch
    nbytes = bytes_per_element * (m * k + k * n + m * n) * batch
    eff = efficiency(gpu)
    s = eff.sustained if sustained is None else sustained
    compute = flops / (gpu.peak(dtype) * eff.gemm(flops) * s)
    return max(compute, memory_time(nbytes, gpu, s))


@dataclass(frozen=True)
class PassCost:
    """Time and FLOPs of one pass (forward, backward or recompute) of one unit on one GPU."""

    time_s: float = 0.0
    flops: float = 0.0

    def __add__(self, other: PassCost) -> PassCost:
        return PassCost(self.time_s + other.time_s, self.flops + other.flops)

    def scaled(self, k: float) -> PassCost:
        return PassCost(self.time_s * k, self.flops * k)


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer, one micro-batch, one GPU of the TP group.

    forward, backward, recompute: compute only (TP communication is added by the engine);
    recompute is what backward re-executes first (zero without recomputation).
    model_flops: forward + backward FLOPs of the model (MFU numerator, no recomputation).
    tp_bytes: payload of one TP all-reduce (or reduce-scatter + all-gather) of the layer
        output, per GPU; a layer runs ``tp_collectives`` of them in forward and as many in
        backward.
    """

    forward: PassCost
    backward: PassCost
    recompute: PassCost
    model_flops: float
    tp_bytes: float
    tp_collectives: int = 2
    # the attention core's seconds in forward and backward (included above): what a context-
    # parallel ring's sends run beside
    attention_fwd_s: float = 0.0
    attention_bwd_s: float = 0.0


def layer_cost(model: Transformer, micro_batch: int, gpu: GPU, *, tp: int = 1,
               sequence_parallel: bool = False, recompute: str = "none",
               attention: str = "flash", precision: str | Precision = "bf16",
               sustained: float | None = None, flash_kernel: str = "cuda",
               recompute_early_stop: bool = False, fp8: str | None = None,
               moe: bool | None = None, ep: int = 1,
               expert_imbalance: float = 1.0, cp: int = 1, cp_comm: str = "p2p",
               grouped_gemm: bool = False, etp: int | None = None) -> LayerCost:
    """Compute cost of one transformer layer of ``model`` for ``micro_batch`` sequences on one
    GPU of a ``tp``-way tensor-parallel group (GEMM shapes from ``Transformer.layer_gemms``:
    Megatron-LM's column- then row-parallel split, Shoeybi et al. 2019), in ``precision`` (a
    name of ``labsim.precision.PRECISIONS``: its compute dtype sets bytes and peak).
    ``sustained``: the software profile's sustained fraction (default: the GPU's);
    ``flash_kernel``: the FlashAttention implementation it runs (``FLASH_KERNELS``);
    ``recompute_early_stop``: full recomputation stops before the layer's last GEMM, as
    PyTorch's non-reentrant checkpoint does by default since 2.1 (``torch.utils.checkpoint``,
    ``set_checkpoint_early_stop``): it stops once every tensor the backward saved is rebuilt,
    and the last one, the MLP output projection's input, is saved before that GEMM runs.
    ``fp8``: a recipe of ``labsim.fp8`` runs the linear layers' GEMMs in FP8, with its casts.
    ``moe``: for a mixture-of-experts model, whether the layer is an MoE layer (True) or one of
    its leading dense layers (False); ``moe_linears`` gives an MoE layer's GEMMs.
    ``ep``, ``expert_imbalance``: expert parallelism (``labsim.expert_parallel``): the rank's
    ``experts / ep`` experts on ``ep`` times the rows each, the busiest rank's (``imbalance``
    times the mean) setting the time; the FLOPs stay the mean rank's.  ``grouped_gemm``: the
    rank's experts run as one grouped GEMM per projection (Megatron-Core ``--moe-grouped-gemm``,
    ``GroupedMLP`` / Transformer Engine's ``GroupedLinear``): one kernel over every local
    expert's rows, priced at the efficiency of their total size, instead of one GEMM per
    expert at its own (``SequentialMLP``, Megatron-Core's default).  ``etp``: the routed
    experts split over ``etp`` GPUs instead of ``tp`` (``moe_linears``).
    ``cp``, ``cp_comm``: context parallelism (``labsim.context_parallel``): every op on the
    rank's ``s / cp`` tokens, attention on its share of the whole sequence's (FLOPs / cp), the
    kernel at the length it sees (a ring's ``s / cp`` blocks, the whole ``s`` otherwise)."""
    check_moe_layer(model, moe)
    imbalance = check_imbalance(expert_imbalance)
    kernel_seq = model.seq_len if cp_comm != "p2p" else model.seq_len // cp
    model = local_model(model, cp)
    if moe and recompute == "op-sac":
        raise ValueError("recompute='op-sac' saves a dense block's matmuls (labsim.op_sac); "
                         "use 'selective' or 'full' for an MoE layer")
    if flash_kernel not in FLASH_KERNELS:
        raise ValueError(f"flash_kernel={flash_kernel!r}: choose one of {FLASH_KERNELS}")
    h, s = model.hidden, model.seq_len
    su = sustained
    prec = training_precision(precision)
    e = prec.activation_bytes
    tokens = micro_batch * s
    gemm_dtype = prec.peak_dtype(gpu)
    lin_dtype, lin_e = (gemm_dtype, e) if fp8 is None else ("fp8", 1)  # the linear layers
    slow = gemm_slowdown(fp8)  # per-block scales applied as the GEMM accumulates
    check_gpu((fp8,), gpu)
    gemms = {g.name: g for g in model.layer_gemms(micro_batch, tp)}
    linears = [(g.name, g.m, g.n, g.k, 1) for g in gemms.values()
               if g.name not in ("attn_scores", "attn_values")]
    if moe:
        linears = [x for x in linears if not x[0].startswith("mlp_")]
        linears += moe_linears(model, tokens, tp, ep, etp)
    fwd = PassCost()
    bwd = PassCost()

    def timed(name: str, m: float, n: int, k: int, count: int) -> float:
        """``count`` identical GEMMs: each alone, or the experts' as one grouped GEMM."""
        if grouped_gemm and name.startswith("expert_"):
            return gemm_time(m, n, k, gpu, lin_dtype, count, lin_e, su) * slow
        return count * gemm_time(m, n, k, gpu, lin_dtype, bytes_per_element=lin_e,
                                 sustained=su) * slow

    for name, rows, n, k, count in linears:  # count: identical GEMMs
        flops = 2.0 * rows * n * k * count
        m = rows * imbalance if name.startswith("expert_") else rows
        fwd += PassCost(timed(name, m, n, k, count), flops)
        # data gradient (m x n) @ (n x k) and weight gradient (k x m) @ (m x n)
        bwd += PassCost(timed(name, m, k, n, count) + timed(name, k, n, m, count), 2.0 * flops)
        if fp8 is not None:  # labsim.fp8: the input's cast (or transpose), the gradient's cast
            cast = cast_bytes(fp8, e) if name == "attn_out" else fused_input_bytes(fp8, e)
            fwd += PassCost(memory_time(count * m * k * cast, gpu, su), 0.0)
            bwd += PassCost(memory_time(count * m * n * cast_bytes(fp8, e), gpu, su), 0.0)

    # Attention core: scores Q K^T and values P V, 2 * 2 * b * s^2 * d FLOP per head.
    qk, pv = gemms["attn_scores"], gemms["attn_values"]
    attn_flops = float(qk.flops + pv.flops)
    if attention == "flash":
        eff = efficiency(gpu)
        peak = gpu.peak(gemm_dtype) * (eff.sustained if su is None else su)
        frac_f, frac_b = eff.flash(flash_kernel, kernel_seq, model.head_dim)
        # causal FlashAttention skips the blocks above the diagonal: half the FLOPs executed
        core_f = PassCost(0.5 * attn_flops / (peak * frac_f), attn_flops)
        core_b = PassCost(0.5 * 2.5 * attn_flops / (peak * frac_b),
                          2.0 * attn_flops)  # FA2 backward: 5 GEMMs vs 2 forward
    else:
        scores = qk.batch * s * s  # elements of the score matrices on this GPU
        t_qk = gemm_time(qk.m, qk.n, qk.k, gpu, gemm_dtype, batch=qk.batch, bytes_per_element=e,
                         sustained=su)
        t_pv = gemm_time(pv.m, pv.n, pv.k, gpu, gemm_dtype, batch=pv.batch, bytes_per_element=e,
                         sustained=su)
        # fused scale-mask-softmax: read + write e B per score; dropout: read, write, 1 B mask
        soft_f = memory_time(scores * (2 * e + 2 * e + 1), gpu, su)
        # backward: dropout (gradient in and out, mask), softmax (probs, gradient in and out)
        soft_b = memory_time(scores * (2 * e + 1 + 3 * e), gpu, su)
        core_f = PassCost(t_qk + t_pv + soft_f, attn_flops)
        core_b = PassCost(2 * (t_qk + t_pv) + soft_b, 2.0 * attn_flops)
    if cp > 1:  # the rank's block of queries against all cp blocks of keys: cp times its own
        core_f, core_b = core_f.scaled(cp), core_b.scaled(cp)
    fwd += core_f
    bwd += core_b

    # Memory-bound element-wise kernels (bytes per element of the b*s*h activations): two
    # norms (read + write), two fused bias-dropout-residual-adds (two reads, one write, a
    # 1-byte mask); the MLP activation on b*s*f/tp (GeLU: read + write; SwiGLU: two reads,
    # one write).  Without sequence parallelism every TP rank repeats the b*s*h ones.
    per_h = 2 * (2 * e) + 2 * (3 * e + 1)
    shard = tp if sequence_parallel else 1
    act = (3 if model.swiglu else 2) * e
    elem_bytes = tokens * h * per_h / shard
    if moe:  # the experts' activations; dispatch and combine move every routed token twice
        k_tok = tokens * model.top_k  # each way; the router's fp32 scores are read and written
        elem_bytes += (k_tok * imbalance * model.expert_ffn_hidden / tp
                       + tokens * model.shared_experts * model.shared_ffn_hidden / tp) * act
        elem_bytes += 2 * k_tok * h * 2 * e + tokens * model.experts * 2 * 4
    else:
        elem_bytes += tokens * (model.ffn_hidden // tp) * act
    fwd += PassCost(memory_time(elem_bytes, gpu, su), 0.0)
    bwd += PassCost(memory_time(2 * elem_bytes, gpu, su), 0.0)  # gradients in and out, inputs

    if recompute == "full":
        rec = fwd
        if recompute_early_stop:  # the MLP's output projections are not run again
            for name, m, n, k, count in (x for x in linears if x[0].endswith("down")):
                rows = m * imbalance if name.startswith("expert_") else m
                rec = PassCost(rec.time_s - timed(name, rows, n, k, count),
                               rec.flops - 2.0 * m * n * k * count)
    elif recompute == "op-sac":
        rec = _op_sac_recompute(model, tokens, tp, gpu, lin_dtype, lin_e, su,
                                fwd_elementwise=memory_time(elem_bytes, gpu, su),
                                slowdown=slow)
        if attention == "standard":  # bmm and softmax are not on torchtitan's save list
            rec += core_f
    elif recompute == "selective" and attention == "standard":
        rec = core_f  # Korthikanti et al. 2022: recompute only the attention core
    else:  # FlashAttention already recomputes its scores inside the backward kernel
        rec = PassCost()
    return LayerCost(fwd, bwd, rec, fwd.flops + bwd.flops, float(tokens * h * e),
                     attention_fwd_s=core_f.time_s, attention_bwd_s=core_b.time_s)


def moe_linears(model: Transformer, tokens: int, tp: int = 1, ep: int = 1,
                etp: int | None = None) -> list[tuple[str, float, int, int, int]]:
    """An MoE layer's GEMMs besides attention on one GPU of a ``tp``-way group and an
    ``ep``-way expert-parallel group, as ``(name, m, n, k, count)``: the router (every token,
    ``h -> experts``), each of the rank's ``experts / ep`` routed experts' up and down
    projections on ``tokens x top_k x ep / experts`` rows (the tokens spread evenly,
    ``labsim.expert_parallel.routed_rows``), each shared expert's on every token; the
    experts' width split over ``tp`` as a dense MLP's is (column- then row-parallel), or, with
    expert tensor parallelism, the routed experts' over ``etp``, each on the rows of ``etp / tp``
    of the tokens (a rank's ``s / tp`` share, gathered over its ``etp`` group).  Each
    expert's GEMM is priced alone, at its own size's efficiency, as Megatron-Core's
    ``SequentialMLP`` runs them, unless ``layer_cost(grouped_gemm=True)`` groups them."""
    h, up = model.hidden, 2 if model.swiglu else 1
    etp = tp if etp is None else etp
    rows = routed_rows(model, tokens * etp / tp, ep)
    out: list[tuple[str, float, int, int, int]] = [("router", tokens, model.experts, h, 1)]
    for prefix, m, width, count, split in (("expert", rows, model.expert_ffn_hidden,
                                            local_experts(model, ep), etp),
                                           ("shared", tokens, model.shared_ffn_hidden,
                                            model.shared_experts, tp)):
        if count:
            out += [(f"{prefix}_up", m, up * width // split, h, count),
                    (f"{prefix}_down", m, h, width // split, count)]
    return out


def _op_sac_recompute(model: Transformer, tokens: int, tp: int, gpu: GPU, gemm_dtype: str,
                      e: int, sustained: float | None, *, fwd_elementwise: float,
                      slowdown: float = 1.0) -> PassCost:
    """What the backward re-executes under torchtitan's op-level selective checkpointing
    (``labsim.op_sac.op_sac_per_layer``): the matmuls whose outputs are not saved
    (``labsim.op_sac.op_sac_matmuls``: wk, wo and w3 for a Llama block; every projection of
    a biased model), column-parallel ones split over ``tp``, each at its own GEMM shape, and
    the layer's memory-bound element-wise kernels (norms, rotary embedding, SiLU and product,
    residual adds), none of which is saved.  The SDPA kernel's output is saved: FlashAttention
    is not re-run."""
    rec = PassCost(fwd_elementwise, 0.0)
    for name, out, inp, saved in op_sac_matmuls(model):
        if saved:
            continue
        row_parallel = name in ("wo", "w2", "fc2")
        n, k = (out, inp // tp) if row_parallel else (out // tp, inp)
        rec += PassCost(gemm_time(tokens, n, k, gpu, gemm_dtype, bytes_per_element=e,
                                  sustained=sustained) * slowdown, 2.0 * tokens * n * k)
    return rec


def logits_cost(model: Transformer, micro_batch: int, gpu: GPU, *, tp: int = 1,
                precision: str | Precision = "bf16",
                sustained: float | None = None) -> tuple[PassCost, PassCost]:
    """Forward and backward of the output layer (logits GEMM, vocabulary split over TP) and
    the cross-entropy (fp32 softmax over the vocabulary shard), on the last stage."""
    prec = training_precision(precision)
    e = prec.activation_bytes
    gemm_dtype = prec.peak_dtype(gpu)
    g = model.head_gemm(micro_batch, tp)
    t_f = gemm_time(g.m, g.n, g.k, gpu, gemm_dtype, bytes_per_element=e, sustained=sustained)
    t_b = (gemm_time(g.m, g.k, g.n, gpu, gemm_dtype, bytes_per_element=e, sustained=sustained)
           + gemm_time(g.k, g.n, g.m, gpu, gemm_dtype, bytes_per_element=e, sustained=sustained))
    ce = memory_time(g.m * g.n * (e + 4), gpu, sustained)  # read logits, write fp32 probabilities
    return PassCost(t_f + ce, float(g.flops)), PassCost(t_b + ce, 2.0 * g.flops)


def optimizer_time(params: float, gpu: GPU, optimizer: str = "adam",
                   sustained: float | None = None) -> float:
    """One optimizer step over ``params`` local parameters: memory-bound.  Adam with fp32
    master weights reads gradient (4 B), master, m, v (12 B) and writes master, m, v and the
    16-bit copy (14 B): 30 B/param; SGD with momentum 18 B; plain SGD 14 B."""
    per_param = {"adam": 30, "sgd-momentum": 18, "sgd": 14}[optimizer]
    return memory_time(params * per_param, gpu, sustained)


KINDS = ("matmul", "attention", "elementwise", "optimizer")


def kind_seconds(model: Transformer, micro_batch: int, gpu: GPU, *,
                 attention: str = "standard", precision: str | Precision = "fp32",
                 optimizer: str = "adam", sustained: float | None = None) -> dict[str, float]:
    """Seconds of one training step of ``model`` on one GPU (no parallelism), by the kinds of
    op a profiler sorts kernels into (``KINDS``, as ``labsim.experiments.profile`` does):
    the layers' and the logits' GEMMs forward and backward (``matmul``), the attention core
    (``attention``: FlashAttention, or the score GEMMs plus softmax and dropout), the
    memory-bound kernels and the cross-entropy (``elementwise``) and the optimizer step.
    The same costs as ``layer_cost`` / ``logits_cost`` / ``optimizer_time``, re-cut by kind."""
    full = layer_cost(model, micro_batch, gpu, attention=attention, precision=precision,
                      sustained=sustained)
    gemm_dtype = training_precision(precision).peak_dtype(gpu)
    e = training_precision(precision).activation_bytes
    matmul = 0.0
    for g in model.layer_gemms(micro_batch, 1):
        if g.name in ("attn_scores", "attn_values"):
            continue
        matmul += (gemm_time(g.m, g.n, g.k, gpu, gemm_dtype, bytes_per_element=e,
                             sustained=sustained)
                   + gemm_time(g.m, g.k, g.n, gpu, gemm_dtype, bytes_per_element=e,
                               sustained=sustained)
                   + gemm_time(g.k, g.n, g.m, gpu, gemm_dtype, bytes_per_element=e,
                               sustained=sustained))
    h, f = model.hidden, model.ffn_hidden
    tokens = micro_batch * model.seq_len
    per_h = 2 * (2 * e) + 2 * (3 * e + 1)
    elem = tokens * h * per_h + tokens * f * (3 if model.swiglu else 2) * e
    elementwise = memory_time(elem, gpu, sustained) + memory_time(2 * elem, gpu, sustained)
    layer_total = full.forward.time_s + full.backward.time_s
    attention_s = max(0.0, layer_total - matmul - elementwise)  # what the layer adds: the core
    head_f, head_b = logits_cost(model, micro_batch, gpu, precision=precision,
                                 sustained=sustained)
    g = model.head_gemm(micro_batch, 1)
    ce = 2 * memory_time(g.m * g.n * (e + 4), gpu, sustained)
    layers = model.layers
    return {"matmul": layers * matmul + head_f.time_s + head_b.time_s - ce,
            "attention": layers * attention_s,
            "elementwise": layers * elementwise + ce,
            "optimizer": optimizer_time(model.params, gpu, optimizer, sustained)}


def softmax_seconds(model: Transformer, micro_batch: int, gpu: GPU, *,
                    precision: str | Precision = "bf16",
                    sustained: float | None = None) -> float:
    """Seconds of one step's memory-bound part of *standard* attention (the fused softmax
    and the dropout over the ``s x s`` scores, forward and backward, every layer): the part
    of ``kind_seconds(..., attention="standard")["attention"]`` that FlashAttention removes
    by never writing the scores to HBM."""
    prec = training_precision(precision)
    e = prec.activation_bytes
    qk = {g.name: g for g in model.layer_gemms(micro_batch, 1)}["attn_scores"]
    scores = qk.batch * model.seq_len * model.seq_len
    per_layer = (memory_time(scores * (2 * e + 2 * e + 1), gpu, sustained)
                 + memory_time(scores * (2 * e + 1 + 3 * e), gpu, sustained))
    return model.layers * per_layer
