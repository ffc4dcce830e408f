"""Software profiles: what a training framework does that the hardware model alone does not say.

A ``Plan`` names a profile (``Plan(software="megatron-core-te")``); the step model reads from it
how the framework communicates and overlaps, and how much of the isolated-kernel speed it
sustains.  Every value carries its provenance; each profile has one fitted number (``fitted``:
the sustained fraction per GPU generation, or for DeepSpeed 2021 the host seconds per rank of
a ZeRO-3 gather), each on a named calibration set of published runs
(``labsim.published.runs()``, ``benchmarks/step.py`` prints the fit and the held-out errors).

Fields:

* ``sustained`` -- fraction of isolated-kernel throughput (``labsim.compute``) kept inside a
  training step: gaps between kernels, launch and synchronisation, clocks under full power,
  unfused element-wise work; by GPU generation ("ampere", "hopper");
* ``tp_comm_overlap`` / ``tp_overlap_hidden`` -- whether tensor-parallel collectives run under
  the GEMMs (Transformer Engine's userbuffers, ``ub_tp_comm_overlap``) and what fraction of
  their time then hides, for a TP group inside one node (``StepCosts.tp_hidden``);
* ``overlap_grad_reduce`` / ``overlap_param_gather`` / ``bucket_bytes`` -- data-parallel
  gradient reduction during backward, the distributed optimizer's parameter all-gather under
  the next forward, the bucket size;
* ``dp_nccl_algo`` -- ``NCCL_ALGO`` for the data-parallel collectives (buckets, ZeRO gathers
  and reductions): ``"auto"`` lets the NCCL model's tuner pick, as NCCL does; ``"ring"``,
  ``"tree"`` or any NCCL_ALGO list forces it, to see what the choice is worth;
* ``zero1_grad_op`` -- how ZeRO-1 reduces the gradients once a step before each rank steps
  its shard of the optimizer: ``"reduce_scatter"`` (Megatron's distributed optimizer) or
  ``"allreduce"``, twice the bytes (DeepSpeed's ``BF16_Optimizer`` under its pipeline engine,
  v0.6.2-v0.6.5: ``PipelineEngine._bf16_reduce_grads`` all-reduces the whole fp32 gradient with
  ``buffered_allreduce_fallback`` in ``MEMORY_OPT_ALLREDUCE_SIZE`` = 5e8-element buckets,
  ``runtime/pipe/engine.py``);
* ``accumulate_bytes_per_param`` -- bytes per parameter that a separate pass moves through HBM
  after every micro-batch's backward to add its gradient into the accumulated one: 18 for
  DeepSpeed's ``BF16_Optimizer.update_hp_grads``, ``hp_grad.add_(lp.grad.to(float32))`` (the
  cast reads 2 and writes 4, the add reads 4 + 4 and writes 4; ``runtime/bf16_optimizer.py``,
  called after each backward by ``_exec_backward_pass``); 0 where the GEMM accumulates
  (Megatron-Core's ``gradient_accumulation_fusion``) or the profile's fitted fraction holds it
  (Megatron-LM's ``main_grad.add_`` hook, autograd's own accumulation);
* ``extra_grad_bytes_per_param`` -- a second gradient the framework keeps through the step
  beside the one the precision counts: 2 for ``BF16_Optimizer``, whose bf16 ``.grad``
  tensors live from one backward until ``clear_lp_grads`` at the start of the next (under
  its pipeline engine, ``_exec_backward_pass``) and so through the forwards between;
* ``zero3_unit`` -- what one ZeRO-3 all-gather fetches: ``"layer"`` (FSDP: one wrapped
  transformer block) or ``"tensor"`` (DeepSpeed 2021: one all-gather per parameter tensor, four
  per GPT layer);
* ``zero3_prefetch`` -- layers whose all-gather may run ahead of the one computing;
* ``zero3_grad_op`` -- how ZeRO-3 reduces gradients: ``"reduce_scatter"`` or ``"allreduce"``
  (DeepSpeed 0.3.x: without ``contiguous_gradients``, off by default for stage 3,
  ``stage3.py`` ``reduce_ipg_grads`` all-reduces the flattened bucket whatever
  ``reduce_scatter`` says);
* ``zero3_recompute_gather`` -- with full recomputation, the recomputed forward of a layer
  gathers its parameters once more before the backward gathers them again (DeepSpeed 0.3.x:
  forward hooks release parameters after every forward, backward hooks fetch them,
  ``stage3.py`` ``_post_forward_module_hook`` / ``_pre_backward_module_hook``); FSDP
  recomputes inside the unit's backward, with the parameters already gathered;
* ``zero3_host_s_per_rank`` -- host seconds per data-parallel rank in every ZeRO-3 all-gather
  call, serial with the step: DeepSpeed 0.3.x builds the output as a Python list of one
  ``narrow`` view per rank (``partition_parameters.py`` ``_allgather_param``) and PyTorch's
  ``ProcessGroupNCCL::allgather`` gathers into a fresh flat buffer, then runs one
  ``recordStream`` and one ``copy_`` per list element into the views (``torch/lib/c10d/
  ProcessGroupNCCL.cpp``, PyTorch 1.8), so a gather over n ranks costs n launches however
  few bytes each moves; every gather is fenced by ``torch.cuda.synchronize()`` before it and
  after its wait (``_allgather_param``, ``stage3.py`` ``_synchronize_communication``);
* ``zero3_gather_hbm_passes`` -- passes of each gathered tensor through HBM besides NCCL's own
  write: the ``torch.zeros`` the gather lands in (a write), PyTorch's copy out of its flat
  buffer (a read and a write), the ``param.norm()`` that ``fetch_sub_module`` evaluates in a
  debug f-string whether or not it prints (a read): 4 in DeepSpeed 0.3.16;
* ``zero3_gather_syncs`` -- every ZeRO-3 gather starts with a device-wide synchronisation, so
  it waits for the gradient reductions in flight on their own stream: a reduction overlaps
  only compute that needs no gather, never a gather (DeepSpeed 0.3.x: ``_allgather_param``
  calls ``torch.cuda.synchronize()`` before it builds the gather, and the reductions run on
  ``reduction_stream``, ``stage3.py`` ``allreduce_and_copy``);
* ``zero3_reuse_distance`` -- a gathered tensor is kept (not released and gathered again) when
  its next use comes within this many parameter elements of other uses (DeepSpeed
  ``stage3_max_reuse_distance``, default 1e9 elements: ``stage3.py`` ``_keep_for_later``); 0:
  always released (FSDP);
* ``fitted`` -- which value is fitted on the profile's calibration runs (``sustained``, or
  ``zero3_host_s_per_rank`` where the sustained fraction is another profile's);
* ``blocking_p2p`` -- a stage waits for its pipeline send to complete before its next op
  (Megatron-LM 2021: ``batch_isend_irecv``, ``req.wait()`` and ``torch.cuda.synchronize()``
  in ``p2p_communication.py``; Megatron-Core overlaps them since 2023);
* ``attention`` -- the attention kernel the framework uses by default;
* ``flash_kernel`` -- which FlashAttention implementation runs when attention is flash
  (``labsim.compute.FLASH_KERNELS``): Dao's CUDA kernels, or the Triton kernel of 2022 that
  llm-foundry's ``attn_impl: triton`` (its benchmarks' default) ran;
* ``recompute_early_stop`` -- full recomputation stops before a layer's last GEMM: PyTorch's
  non-reentrant ``torch.utils.checkpoint`` (what FSDP's ``checkpoint_wrapper`` with
  ``CheckpointImpl.NO_REENTRANT`` runs) stops recomputing once every saved tensor is rebuilt,
  by default since PyTorch 2.1 (pytorch/pytorch#96866); Megatron-LM and DeepSpeed run their
  own checkpoint functions, which replay the whole forward;
* ``swiglu_fused`` -- a SwiGLU MLP's ``silu(gate) * up`` is one autograd function that keeps
  its input only and recomputes the SiLU in backward, so the MLP keeps three f-wide tensors
  (gate and up, and the product as the down projection's input), not four
  (``labsim.memory.activation_per_layer``): Megatron-Core's ``bias_swiglu_impl``
  (``megatron/core/fusions/fused_bias_swiglu.py``, ``SwiGLUFunction`` saves its input),
  on by default in Megatron-LM's training arguments (``--no-bias-swiglu-fusion`` turns it
  off); eager PyTorch (``F.silu(gate) * up``) keeps four;
* ``cross_entropy`` -- the loss kernel, which sets what the logits and the loss hold at the
  start of backward (``labsim.memory.loss_memory``): ``"eager"`` (``F.cross_entropy`` on an
  fp32 copy of the logits: the logits, the copy, the saved log-softmax and its gradient, all
  but the first in fp32; torchtitan ``train.py``), ``"megatron"`` (Megatron's
  ``_VocabParallelCrossEntropy``: the fp32 copy becomes the softmax in place, is saved, and
  its backward writes the gradient into it; ``megatron/core/tensor_parallel/
  cross_entropy.py``), ``"flash-attn"`` (flash-attn's fused ``CrossEntropyLoss``, llm-foundry's
  default ``loss_fn: fused_crossentropy``: it saves the logits and a per-row log-sum-exp and
  writes a gradient in the logits' dtype; ``flash_attn/losses/cross_entropy.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

from labsim.collectives.tuner import ALGOS, parse_choice
from labsim.efficiency import FLASH_KERNELS
from labsim.hardware import GPU
from labsim.loss import CROSS_ENTROPY

ZERO3_UNITS = ("layer", "tensor")
ZERO3_GRAD_OPS = ("reduce_scatter", "allreduce")
ZERO1_GRAD_OPS = ZERO3_GRAD_OPS
FITTED = ("sustained", "zero3_host_s_per_rank")


@dataclass(frozen=True)
class SoftwareProfile:
    """One framework's behaviour (module doc); ``source`` names where each value comes from."""

    name: str
    description: str
    sustained: Mapping[str, float]
    tp_comm_overlap: bool = False
    tp_overlap_hidden: float = 0.0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    bucket_bytes: float = 25 * 2**20  # PyTorch DDP: bucket_cap_mb=25, in MiB
    dp_nccl_algo: str = "auto"
    zero1_grad_op: str = "reduce_scatter"
    accumulate_bytes_per_param: float = 0.0
    extra_grad_bytes_per_param: float = 0.0
    zero3_unit: str = "layer"
    zero3_prefetch: int = 1
    zero3_grad_op: str = "reduce_scatter"
    zero3_recompute_gather: bool = False
    zero3_host_s_per_rank: float = 0.0
    zero3_gather_hbm_passes: float = 0.0
    zero3_gather_syncs: bool = False
    zero3_reuse_distance: float = 0.0
    blocking_p2p: bool = False
    attention: str = "flash"
    flash_kernel: str = "cuda"
    recompute_early_stop: bool = False
    swiglu_fused: bool = False
    cross_entropy: str = "eager"
    fitted: str = "sustained"
    source: str = ""
    calibration: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sustained", MappingProxyType(dict(self.sustained)))
        if self.zero3_unit not in ZERO3_UNITS:
            raise ValueError(f"zero3_unit={self.zero3_unit!r}: choose one of {ZERO3_UNITS}")
        if self.zero3_grad_op not in ZERO3_GRAD_OPS:
            raise ValueError(f"zero3_grad_op={self.zero3_grad_op!r}: choose one of "
                             f"{ZERO3_GRAD_OPS}")
        parse_choice(self.dp_nccl_algo, ALGOS, "dp_nccl_algo")  # raises naming the choices
        if self.zero1_grad_op not in ZERO1_GRAD_OPS:
            raise ValueError(f"zero1_grad_op={self.zero1_grad_op!r}: choose one of "
                             f"{ZERO1_GRAD_OPS}")
        for name in ("zero3_host_s_per_rank", "zero3_gather_hbm_passes",
                     "zero3_reuse_distance", "accumulate_bytes_per_param",
                     "extra_grad_bytes_per_param"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        if not isinstance(self.zero3_gather_syncs, bool):
            raise ValueError(f"zero3_gather_syncs={self.zero3_gather_syncs!r} must be True or "
                             "False")
        if not isinstance(self.swiglu_fused, bool):
            raise ValueError(f"swiglu_fused={self.swiglu_fused!r} must be True or False")
        if not isinstance(self.recompute_early_stop, bool):
            raise ValueError(f"recompute_early_stop={self.recompute_early_stop!r} must be True "
                             "or False")
        if self.flash_kernel not in FLASH_KERNELS:
            raise ValueError(f"flash_kernel={self.flash_kernel!r}: choose one of "
                             f"{FLASH_KERNELS}")
        if self.cross_entropy not in CROSS_ENTROPY:
            raise ValueError(f"cross_entropy={self.cross_entropy!r}: choose one of "
                             f"{CROSS_ENTROPY}")
        if self.fitted not in FITTED:
            raise ValueError(f"fitted={self.fitted!r}: choose one of {FITTED}")
        for key, value in self.sustained.items():
            if not 0 < value <= 1:
                raise ValueError(f"sustained[{key!r}]={value!r} must be in (0, 1]")

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> tuple:
        """Pickle by value (a mapping proxy cannot be pickled), e.g. to a worker process."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["sustained"] = dict(self.sustained)
        return (_profile_from_fields, (values,))

    def sustained_for(self, gpu: GPU) -> float:
        """The sustained fraction on ``gpu``'s generation (the generic profile's if the
        profile was not calibrated there)."""
        return self.sustained.get(gpu.arch, GENERIC_SUSTAINED.get(gpu.arch, 0.8))


def _profile_from_fields(values: dict) -> SoftwareProfile:
    return SoftwareProfile(**values)


# Host seconds per rank per ZeRO-3 all-gather of DeepSpeed 0.3.16 on PyTorch 1.8
# (``zero3_host_s_per_rank``): fitted on the 175B runs of Narayanan et al. 2021 Table 2
# (``python benchmarks/step.py --fit``); the 529.6B runs are held out.
ZERO3_HOST_S_PER_RANK_2021 = 20e-6

# Sustained fraction of Megatron-LM 2022 on A100 (``python benchmarks/step.py --fit``, on
# Korthikanti et al. 2022's 22B and 175B runs).
MEGATRON_LM_2022_AMPERE = 0.836

# No framework in particular: the mean of the calibrated profiles' fitted fractions on each
# generation, to two places (Ampere: Megatron-LM 2021 0.804, Megatron-LM 2022 0.836, FSDP
# 0.871; Hopper: Megatron-Core 0.746, FSDP 0.696); Volta and Blackwell have no calibration run
# and take their neighbour's.
GENERIC_SUSTAINED = MappingProxyType({"volta": 0.84, "ampere": 0.84, "hopper": 0.72,
                                      "blackwell": 0.72})

_FSDP = SoftwareProfile(
    "fsdp", "PyTorch FSDP (FULL_SHARD) as in MosaicML llm-foundry / Composer on PyTorch 2.1: one "
    "unit per transformer block, backward prefetch, gradients reduce-scattered per unit, "
    "FlashAttention (llm-foundry's Triton kernel of 2022), non-reentrant activation "
    "checkpointing (recomputation stops early)",
    MappingProxyType({"ampere": 0.871, "hopper": 0.696}), flash_kernel="triton-2022",
    recompute_early_stop=True, cross_entropy="flash-attn",
    source="PyTorch FSDP docs (BackwardPrefetch.BACKWARD_PRE, limit_all_gathers); "
    "llm-foundry benchmarking README; scripts/train/benchmarking/submit_benchmarks.py "
    "(--attn_impl default 'triton', which sweep.sh never changes) and "
    "llmfoundry/models/layers/attention.py (attn_impl triton: flash_attn_triton.py on "
    "triton-pre-mlir); yamls: activation_checkpointing_reentrant: false; sweep.sh: "
    "mosaicml/pytorch:2.1.0_cu121; llmfoundry/models/mpt/modeling_mpt.py (loss_fn default "
    "'fused_crossentropy': flash_attn.losses.cross_entropy.CrossEntropyLoss)",
    calibration="llm-foundry 8-GPU A100-80GB and H100 runs (5 runs)")

_PROFILES: tuple[SoftwareProfile, ...] = (
    SoftwareProfile(
        "generic", "no framework in particular: PyTorch DDP-like overlap, FSDP-like ZeRO-3",
        GENERIC_SUSTAINED,
        source="PyTorch DDP bucket_cap_mb=25 and overlap (Li et al. 2020); FSDP one unit per "
        "layer with backward prefetch"),
    SoftwareProfile(
        "megatron-lm-2021", "Megatron-LM of Narayanan et al. 2021 (SC21): fp16, fused kernels, "
        "standard (non-flash) attention, blocking TP collectives, local DDP without overlap",
        MappingProxyType({"ampere": 0.804}), overlap_grad_reduce=False, attention="standard",
        blocking_p2p=True, cross_entropy="megatron",
        source="Megatron-LM examples/sc21/run_table_1.sh; Narayanan et al. 2021 sec. 5; "
        "megatron/p2p_communication.py of May 2021 (blocking sends)",
        calibration="Narayanan et al. 2021 Table 1 (10 runs)"),
    SoftwareProfile(
        "megatron-lm-2022", "Megatron-LM of Korthikanti et al. 2022: Megatron-LM 2021's "
        "schedule and communication (blocking TP collectives and pipeline sends, standard "
        "attention) in the paper's own later code, measured a year later on the same cluster, "
        "with sequence parallelism and selective recomputation",
        MappingProxyType({"ampere": MEGATRON_LM_2022_AMPERE}), overlap_grad_reduce=False,
        attention="standard", blocking_p2p=True, cross_entropy="megatron",
        source="Korthikanti et al. 2022 (arXiv:2205.05198) sec. 6 and Table 5 (Selene, "
        "the 2021 paper's cluster); the same 1T and 530B pipelines, with full recomputation, "
        "took 94.4 s and 49.1 s there against 103 s and 54.1 s per step in Narayanan et al. "
        "2021 Table 1",
        calibration="Korthikanti et al. 2022 Table 5, 22B and 175B, full and selective "
        "recomputation (4 runs; the 530B and 1T runs are held out)"),
    SoftwareProfile(
        "megatron-core-te", "NeMo / Megatron-Core with Transformer Engine: TP communication "
        "overlapped with GEMMs, distributed optimizer with overlapped gradient reduce-scatter "
        "and parameter all-gather, FlashAttention (cuDNN)",
        MappingProxyType({"hopper": 0.746}), tp_comm_overlap=True, tp_overlap_hidden=0.8,
        overlap_grad_reduce=True, overlap_param_gather=True, bucket_bytes=40e6,
        swiglu_fused=True, cross_entropy="megatron",
        source="NVIDIA dgxc-benchmarking 24.11 recipes (ub_tp_comm_overlap, overlap_grad_sync, "
        "overlap_param_sync: true); Megatron-Core DDP default bucket 40M elements; fused "
        "SwiGLU: megatron/core/fusions/fused_bias_swiglu.py, on unless "
        "--no-bias-swiglu-fusion (megatron/training/arguments.py)",
        calibration="DGX-Cloud 24.11 BF16, smallest scale of each model (3 runs)"),
    SoftwareProfile(
        "deepspeed-zero3-2021", "DeepSpeed 0.3.x ZeRO-3 as in Narayanan et al. 2021 sec. 5.2: "
        "one all-gather per parameter tensor, prefetch bucket 5e7 elements (less than one "
        "large tensor; every gather after torch.cuda.synchronize()), each gather a list of "
        "one view per rank (a copy launched per rank), gradients all-reduced in "
        "5e8-element buckets on a stream of their own that every gather's "
        "torch.cuda.synchronize() waits for, parameters fetched again for recomputation",
        MappingProxyType({"ampere": 0.804}), zero3_unit="tensor", zero3_prefetch=0,
        zero3_grad_op="allreduce", zero3_recompute_gather=True, bucket_bytes=1e9,
        zero3_host_s_per_rank=ZERO3_HOST_S_PER_RANK_2021, zero3_gather_hbm_passes=4,
        zero3_gather_syncs=True, zero3_reuse_distance=1e9,
        attention="standard", fitted="zero3_host_s_per_rank", cross_entropy="megatron",
        source="DeepSpeed v0.3.16 deepspeed/runtime/zero/constants.py (prefetch_bucket_size "
        "5e7, reduce_bucket_size 5e8, reduce_scatter false, param_persistence_threshold 1e5: "
        "biases and layer norms stay whole, max_reuse_distance 1e9), partition_parameters.py "
        "(_allgather_param per tensor: torch.zeros, torch.cuda.synchronize(), a list of "
        "world_size narrow views), "
        "stage3.py (hooks; fetch_sub_module's param.norm() and synchronize; "
        "allreduce_and_copy on reduction_stream); PyTorch 1.8 "
        "ProcessGroupNCCL::allgather (flat buffer, one recordStream + copy_ per list "
        "element); no overlap: DeepSpeed issues #1069 / #1174 and PR #1188 (June 2021: 'the "
        "async version is not async at all'); sustained: Megatron-LM 2021's (same kernels)",
        calibration="Narayanan et al. 2021 Table 2, ZeRO-3 GPT-3 175B on 384 / 768 / 1536 GPUs "
        "(3 runs; the 529.6B runs are held out)"),
    SoftwareProfile(
        "megatron-deepspeed-2022", "Megatron-DeepSpeed with DeepSpeed's pipeline engine and "
        "BF16_Optimizer, as BigScience trained BLOOM in 2022: 1F1B with blocking sends of each "
        "tensor-parallel rank's share of the activation, gradients accumulated in fp32 by a "
        "pass after every micro-batch and all-reduced in fp32 after the last one (no "
        "overlap), each rank stepping its shard of the optimizer (ZeRO-1) and all-gathering "
        "the bf16 parameters; Megatron-LM's fused kernels, standard attention, and DeepSpeed's "
        "activation checkpointing (the whole forward replayed)",
        MappingProxyType({"ampere": 0.804}), overlap_grad_reduce=False, blocking_p2p=True,
        attention="standard", zero1_grad_op="allreduce", accumulate_bytes_per_param=18,
        extra_grad_bytes_per_param=2, bucket_bytes=2e9, cross_entropy="megatron",
        source="DeepSpeed v0.6.2-v0.6.5 (April-May 2022, the first releases with "
        "BF16_Optimizer): runtime/pipe/engine.py (is_pipe_partitioned: each model-parallel "
        "rank sends its part of the activation and the receiver all-gathers it; "
        "_exec_backward_pass: clear_lp_grads before and update_hp_grads after every backward; "
        "_exec_reduce_grads -> _bf16_reduce_grads: buffered_allreduce_fallback of the fp32 "
        "gradients, MEMORY_OPT_ALLREDUCE_SIZE 5e8 elements, after the last micro-batch), "
        "runtime/pipe/p2p.py (send: dist.send, async_op refused), runtime/bf16_optimizer.py "
        "(update_hp_grads; step, then all_gather_dp_groups of the bf16 shards); "
        "bigscience-workshop/bigscience train/tr11-176B-ml/README.md ('The new BF16_Optimizer "
        "accumulates grads in fp32. It doesn't shard the static fp32 buffer'); sustained: "
        "Megatron-LM 2021's (the same Megatron kernels; not fitted)",
        calibration=""),
    _FSDP,
    SoftwareProfile(
        "torchtitan-2024", "torchtitan (PyTorch native, 2024): FSDP2 (fully_shard per "
        "transformer block, the next block's all-gather issued ahead on its own stream, "
        "gradients reduce-scattered per block), PyTorch SDPA's FlashAttention-2 kernel, eager "
        "SwiGLU, non-reentrant activation checkpointing (recomputation stops early), op-level "
        "selective checkpointing when the plan asks for op-sac",
        GENERIC_SUSTAINED, recompute_early_stop=True,
        source="pytorch/torchtitan at a88dc4125 (October 2024): "
        "torchtitan/parallelisms/parallelize_llama.py (apply_fsdp: "
        "fully_shard per TransformerBlock, reshard_after_forward; apply_ac: "
        "ptd_checkpoint_wrapper, non-reentrant, selective_ac_option 'op' or a layer "
        "frequency); torchtitan/models/llama/model.py (F.scaled_dot_product_attention, "
        "is_causal; F.silu(w1(x)) * w3(x)); PyTorch FSDP2 docs (implicit prefetch of the "
        "next all-gather); sustained: no run of this stack is fitted, the generic mean of the "
        "calibrated profiles",
        calibration=""),
    replace(
        _FSDP, name="fsdp-torch1.13",
        description="PyTorch FSDP as llm-foundry ran it on PyTorch 1.13 (its README's A100 "
        "40GB table): fsdp, but recomputation replays the whole forward (no early stop before "
        "PyTorch 2.1)", recompute_early_stop=False,
        source=_FSDP.source + "; the README's tables carried '#### TODO: Update tables with "
        "torch 2.0 after next Composer release' (commit 300cc5c58, May 2023) and the A100 40GB "
        "table was not run again when the A100 80GB one was (b2a43a1, October 2023, "
        "sweep.sh: mosaicml/pytorch:2.1.0_cu121); sustained: fsdp's (same kernels; not fitted)",
        calibration=""),
)
PROFILES: Mapping[str, SoftwareProfile] = MappingProxyType({p.name: p for p in _PROFILES})


def profile(name: str | SoftwareProfile) -> SoftwareProfile:
    """The profile called ``name`` (a ``SoftwareProfile`` passes through)."""
    if isinstance(name, SoftwareProfile):
        return name
    if not isinstance(name, str) or name.lower() not in PROFILES:
        raise ValueError(f"unknown software profile {name!r}; choose one of "
                         f"{', '.join(PROFILES)}")
    return PROFILES[name.lower()]
