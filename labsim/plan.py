"""``Plan``: how one training step is parallelised and executed.

A plan is the single contract between a model, a cluster and the step models
(``labsim.estimate_step``, ``labsim.simulate_step``).  It says how the GPUs are split (data
parallel ``dp`` x tensor parallel ``tp`` x pipeline parallel ``pp``, the Megatron-LM "3D" layout
of Narayanan et al. 2021), how the global batch is cut into micro-batches, which pipeline
schedule runs them, how much of the model state ZeRO shards (Rajbhandari et al. 2020), what is
recomputed in backward (Korthikanti et al. 2022), how gradients are reduced, and which software
profile (``labsim.software``) the framework behaves like.

Checks that need only the plan happen here (``Plan(...)`` raises ``ValueError`` naming the fix);
checks against a model and a cluster (heads divisible by tp, layers by pp x virtual stages,
dp x tp x pp = GPUs) happen in ``Plan.validate_for`` which the step models call.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from labsim.context_parallel import CP_COMM, check_cp
from labsim.expert_parallel import check_capacity, check_ep, check_imbalance, expert_load
from labsim.fp8 import check_recipe
from labsim.pipeline import group_problems
from labsim.precision import Precision, training_precision
from labsim.software import PROFILES, SoftwareProfile, profile

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full", "op-sac")
ATTENTION = ("flash", "standard")
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")
MAX_GLOBAL_BATCH = 10**8  # sequences; the largest published runs use ~10^4
MIN_BUCKET_BYTES = 1e3


def _whole(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}={value!r}: must be a whole number >= {low} (e.g. {name}="
                         f"{max(low, 1)})")
    return int(value)


def _flag(name: str, value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{name}={value!r}: must be True or False")


def _choice(name: str, value: object, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name}={value!r}: choose one of {options}")
    return value


@dataclass(frozen=True)
class Plan:
    """One parallel execution plan for a training step.

    dp, tp, pp: data-, tensor- and pipeline-parallel degrees (GPUs = dp * tp * pp).
    micro_batch: sequences per micro-batch on one pipeline; ``global_batch`` sequences per
        optimizer step over all replicas (default: ``dp * micro_batch``, one micro-batch each).
        Each replica runs ``m = global_batch / (dp * micro_batch)`` micro-batches (gradient
        accumulation when pp = 1, pipeline filling when pp > 1).
    schedule: ``"gpipe"`` (all forwards then all backwards, Huang et al. 2019), ``"1f1b"``
        (PipeDream-Flush, Narayanan et al. 2021) or ``"interleaved"`` (1F1B over
        ``virtual_stages`` model chunks per GPU, Narayanan et al. 2021 section 2.2.2).
    zero_stage: 0 (plain DP), 1 (optimizer states sharded: Megatron's distributed optimizer),
        2 (+ gradients, reduce-scattered every micro-batch), 3 (+ parameters: all-gathered for
        every layer's forward and backward of every micro-batch).
    recompute: ``"none"``, ``"selective"`` (attention core recomputed, Korthikanti et al. 2022),
        ``"full"`` (each layer's forward recomputed from its input in backward) or
        ``"op-sac"`` (torchtitan's op-level selective checkpointing: every other matmul output
        and the attention kernel's output kept, the rest recomputed;
        ``labsim.op_sac.op_sac_per_layer``).
    sequence_parallel: Megatron sequence parallelism (norms and dropout sharded over tp;
        all-reduces become reduce-scatter + all-gather of the same volume).
    precision: a name of ``labsim.precision.PRECISIONS`` (``"bf16"``, ``"fp16"``, ``"fp32"``,
        ``"mixed-fp32-grads"``, ``"autocast-bf16"``, ``"pure-bf16"`` ...).
    software: a profile of ``labsim.software.PROFILES`` (``"generic"``, ``"megatron-lm-2021"``,
        ``"megatron-core-te"``, ``"deepspeed-zero3-2021"``, ``"megatron-deepspeed-2022"``,
        ``"fsdp"`` ...); the fields below left at None take the profile's value.
    overlap_grad_reduce: reduce each gradient bucket as soon as it is final, under the rest of
        backward (PyTorch DDP); False: after the last backward (Megatron's local DDP of 2021).
    bucket_bytes: gradient bucket size (PyTorch DDP ``bucket_cap_mb=25``).
    tp_comm_overlap: run tensor-parallel collectives under the GEMMs (Megatron-Core with
        Transformer Engine); False: blocking, as Megatron-LM 2021.  Only inside a node: a TP
        group that spans nodes communicates blocking either way (``StepCosts.tp_hidden``).
    zero3_prefetch: ZeRO-3 layers whose all-gather runs ahead of the one computing.
    attention: ``"flash"`` (fused kernel; no s x s tensor in HBM) or ``"standard"``.
    optimizer: ``"adam"``, ``"sgd"`` or ``"sgd-momentum"``.
    account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split: count the
        embedding (the output layer and loss) as one layer when the layers are split over the
        ``pp * virtual_stages`` model chunks, so the first (last) chunk holds one layer less
        (Megatron-Core's options of these names, ``TransformerConfig``; Llama 3 405B: 126
        layers + 2 over 16 stages of 8 chunks, "the first model chunk on the first stage has
        only the embedding", Llama Team 2024, section 3.3.2).  ``chunk_layers`` gives the split.
    microbatch_group: the interleaved schedule's micro-batch group N, the micro-batches a stage
        runs through one chunk in a row: Megatron-Core's tunable schedule
        (``microbatch_group_size_per_vp_stage``, its default p; Llama 3's N), from p to m
        micro-batches, with no "every forward first when m = p" case and no need for m to be a
        multiple of p.  None: Megatron-LM's order (groups of p).  A larger N holds more
        activations on the early stages (``labsim.pipeline.interleaved_one_f_one_b``).
    fp8: the linear layers' GEMMs in FP8 with Transformer Engine's ``"delayed"`` or
        ``"current"`` scaling (``labsim.fp8``), the rest in the precision's 16-bit dtype; None:
        no FP8.  Needs a GPU with FP8 tensor cores.
    ep: expert parallelism (``labsim.expert_parallel``): each MoE layer's experts split over
        ``ep`` neighbouring data-parallel ranks, tokens dispatched to them and combined back by
        two all-to-alls per layer forward and two in backward.  Divides ``dp`` and the experts.
    expert_imbalance: routed tokens on the busiest expert-parallel rank over the mean (1:
        balanced); the MoE layer waits for that rank.
    etp: expert tensor parallelism (Megatron-Core's ``--expert-tensor-parallel-size``, MoE
        parallel folding, Liu et al. 2025, arXiv:2504.14960): each routed expert split over
        ``etp`` GPUs instead of ``tp``, its expert-parallel group ``ep`` ranks ``etp`` apart
        inside each stage's ``tp * cp * dp`` GPUs (``ep * etp`` divides them); None: ``tp``.
    moe_grouped_gemm: each rank's experts run as one grouped GEMM per projection
        (Megatron-Core's ``--moe-grouped-gemm``); False (its default): one GEMM per expert.
    ep_node_limit: DeepSeek-V3's node-limited routing with deduplicated dispatch (DeepEP):
        each token's experts lie on at most this many nodes, and it crosses InfiniBand once
        per node it needs, forwarded over NVLink inside the node
        (``labsim.expert_parallel.node_limited_loads``); None: NCCL's all-to-all, one copy per
        routed expert.  Needs ep > 1.
    capacity_factor, pad_to_capacity: None (default) is a dropless MoE; a number caps each
        expert at that many times its balanced share of the routed tokens and drops the rest
        (Megatron-Core's ``--moe-expert-capacity-factor``), so the busiest rank does at most
        that many times the mean; ``pad_to_capacity`` pads every expert to its capacity
        (``--moe-pad-expert-input-to-capacity``): exactly that many times the mean
        (``Plan.expert_load``).
    ep_overlap: the all-to-alls run beside another micro-batch's compute (Megatron-Core 0.14's
        ``--overlap-moe-expert-parallel-comm``, DeepSeek-V3's DualPipe): only what outlasts a
        layer's forward and backward shows.  Needs ep > 1.
    cp, cp_comm: context parallelism (``labsim.context_parallel``): every sequence split over
        ``cp`` GPUs (GPUs = dp * tp * pp * cp), attention's keys and values passed round a ring
        (``"p2p"``, overlapped with attention), all-gathered (``"all_gather"``) or exchanged by
        all-to-alls (``"a2a"``, Ulysses); gradients are reduced over dp * cp ranks.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    global_batch: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    precision: str = "bf16"
    overlap_grad_reduce: bool | None = None
    bucket_bytes: float | None = None
    attention: str | None = None
    optimizer: str = "adam"
    software: str | SoftwareProfile = "generic"
    tp_comm_overlap: bool | None = None
    zero3_prefetch: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    microbatch_group: int | None = None
    fp8: str | None = None
    ep: int = 1
    expert_imbalance: float = 1.0
    cp: int = 1
    cp_comm: str = "p2p"
    ep_overlap: bool = False
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    ep_node_limit: int | None = None
    moe_grouped_gemm: bool = False
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "virtual_stages", "ep", "cp"):
            object.__setattr__(self, name, _whole(name, getattr(self, name)))
        if self.etp is not None:
            object.__setattr__(self, "etp", _whole("etp", self.etp))
        if (self.tp * self.cp * self.dp) % (self.ep * self.expert_tp):
            raise ValueError(
                f"ep={self.ep} x etp={self.expert_tp} does not divide tp x cp x dp = "
                f"{self.tp * self.cp * self.dp}: the experts' grid (etp x ep x the rest) is "
                "laid over each stage's GPUs (Megatron-Core's MoE parallel folding); choose ep "
                "dividing dp" + (" or a smaller etp" if self.expert_tp > 1 else ""))
        object.__setattr__(self, "expert_imbalance", check_imbalance(self.expert_imbalance))
        object.__setattr__(self, "capacity_factor",
                           check_capacity(self.capacity_factor, self.pad_to_capacity))
        _choice("cp_comm", self.cp_comm, CP_COMM)
        if not isinstance(self.ep_overlap, bool):
            raise ValueError(f"ep_overlap={self.ep_overlap!r}: must be True or False")
        if self.ep_node_limit is not None:
            object.__setattr__(self, "ep_node_limit", _whole("ep_node_limit",
                                                             self.ep_node_limit))
            if self.ep == 1:
                raise ValueError(f"ep_node_limit={self.ep_node_limit} limits the nodes an "
                                 "expert-parallel dispatch reaches: set ep > 1 or leave "
                                 "ep_node_limit None")
        if not isinstance(self.moe_grouped_gemm, bool):
            raise ValueError(f"moe_grouped_gemm={self.moe_grouped_gemm!r}: must be True or False")
        if self.ep_overlap and self.ep == 1:
            raise ValueError("ep_overlap=True overlaps expert parallelism's all-to-alls: set "
                             "ep > 1 or leave ep_overlap False")
        if self.gpus > 2**20:
            raise ValueError(f"{self._product} = {self.gpus:,} GPUs is more than the 1,048,576 "
                             "this simulator accepts; use smaller degrees")
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.dp * self.micro_batch)
        object.__setattr__(self, "global_batch", _whole("global_batch", self.global_batch))
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise ValueError(f"global_batch={self.global_batch:,} sequences is more than the "
                             f"{MAX_GLOBAL_BATCH:,} accepted here (published runs use ~10^4); "
                             "use a smaller global batch")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by dp * micro_batch = "
                f"{self.dp} * {self.micro_batch} = {self.dp * self.micro_batch}; choose a "
                f"global batch that is a multiple of {self.dp * self.micro_batch}"
            )
        _choice("schedule", self.schedule, SCHEDULES)
        if self.schedule == "interleaved":
            if self.pp < 2:
                raise ValueError(
                    "interleaved schedule needs pipeline parallelism: set pp > 1 or use "
                    "schedule='1f1b'"
                )
            if self.virtual_stages < 2:
                raise ValueError(
                    "interleaved schedule needs virtual_stages >= 2 (model chunks per GPU); "
                    "with virtual_stages=1 use schedule='1f1b'"
                )
        elif self.virtual_stages != 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved' "
                f"(schedule={self.schedule!r} runs one model chunk per GPU)"
            )
        if self.microbatch_group is not None:
            if self.schedule != "interleaved":
                raise ValueError(
                    f"microbatch_group={self.microbatch_group!r} groups the interleaved "
                    f"schedule's micro-batches; schedule={self.schedule!r} has none: leave "
                    "it None or use schedule='interleaved'")
            problem = group_problems(self.pp, self.microbatches, self.microbatch_group)
            if problem:
                raise ValueError(problem)
        elif self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ValueError(
                f"the interleaved schedule needs the micro-batch count per replica "
                f"({self.microbatches}) to be a multiple of pp={self.pp} (Megatron-LM's "
                f"requirement); change global_batch or micro_batch"
                + (f", or give microbatch_group (Megatron-Core's order, groups of {self.pp} to "
                   f"{self.microbatches} micro-batches, the last group at least {self.pp})"
                   if self.microbatches > self.pp else "")
            )
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r}: choose 0, 1, 2 or 3")
        if self.zero_stage >= 2 and self.pp > 1:
            raise ValueError(
                f"zero_stage={self.zero_stage} with pp={self.pp}: gradient and parameter "
                "sharding do not combine with pipeline parallelism (DeepSpeed's pipeline "
                "engine refuses ZeRO-2/3); use zero_stage <= 1 or pp = 1"
            )
        _choice("recompute", self.recompute, RECOMPUTE)
        if _flag("sequence_parallel", self.sequence_parallel) is None:
            raise ValueError("sequence_parallel=None: must be True or False")
        if not isinstance(self.precision, (str, Precision)):
            raise ValueError(f"precision={self.precision!r}: must be a name such as 'bf16'")
        try:
            training_precision(self.precision)
        except ValueError as exc:
            raise ValueError(f"precision={self.precision!r}: {exc}") from None
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.fp8 is not None:
            check_recipe(self.fp8)
            if training_precision(self.precision).compute not in ("bf16", "fp16"):
                raise ValueError(f"fp8={self.fp8!r} with precision={self.precision!r}: FP8 "
                                 "GEMMs run inside 16-bit training; use a bf16 precision")
        if not isinstance(self.software, SoftwareProfile) and (
                not isinstance(self.software, str) or self.software not in PROFILES):
            raise ValueError(f"software={self.software!r}: choose one of {tuple(PROFILES)}")
        for name in ("account_for_embedding_in_pipeline_split",
                     "account_for_loss_in_pipeline_split"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        self._resolve_defaults()
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence_parallel needs tp > 1 (it shards over the TP group)")

    def _resolve_defaults(self) -> None:
        prof = profile(self.software)
        for name in ("overlap_grad_reduce", "tp_comm_overlap"):
            value = _flag(name, getattr(self, name))
            object.__setattr__(self, name, getattr(prof, name) if value is None else value)
        if self.attention is None:
            object.__setattr__(self, "attention", prof.attention)
        _choice("attention", self.attention, ATTENTION)
        if self.bucket_bytes is None:
            object.__setattr__(self, "bucket_bytes", prof.bucket_bytes)
        b = self.bucket_bytes
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) or \
                b <= 0:
            raise ValueError(f"bucket_bytes={b!r}: must be a finite number of bytes > 0 "
                             "(PyTorch DDP's default is 25 MiB, 25 * 2**20)")
        if b < MIN_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes={b!r}: buckets below {MIN_BUCKET_BYTES:g} bytes "
                             "are not simulated (frameworks use megabytes); use >= 1e3")
        object.__setattr__(self, "bucket_bytes", float(b))
        if self.zero3_prefetch is None:
            object.__setattr__(self, "zero3_prefetch", prof.zero3_prefetch)
        object.__setattr__(self, "zero3_prefetch",
                           _whole("zero3_prefetch", self.zero3_prefetch, low=0))

    @property
    def gpus(self) -> int:
        """GPUs the plan occupies: dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def gradient_ranks(self) -> int:
        """GPUs that hold the same parameters and reduce their gradients (and shard ZeRO's
        states): the data-parallel ranks and, with context parallelism, theirs (dp * cp)."""
        return self.dp * self.cp

    @property
    def _product(self) -> str:
        return "dp * tp * pp" + (" * cp" if self.cp > 1 else "")

    @property
    def microbatches(self) -> int:
        """Micro-batches per replica per step: global_batch / (dp * micro_batch)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def chunk_layers(self, layers: int) -> tuple[int, ...]:
        """Transformer layers of each of the ``pp * virtual_stages`` model chunks, in model
        order (chunk ``g`` runs on stage ``g % pp``): ``layers`` split evenly, the embedding
        and the loss counted as a layer each where the plan says so (Megatron-Core
        ``get_num_layers_to_build``).  Raises ``ValueError`` naming the fix when the count
        does not split evenly."""
        chunks = self.pp * self.virtual_stages
        extra = (int(self.account_for_embedding_in_pipeline_split)
                 + int(self.account_for_loss_in_pipeline_split))
        total = layers + extra
        counted = f"layers={layers}" + (f" + {extra} (the embedding / loss counted as layers)"
                                        if extra else "")
        if chunks > total:
            raise ValueError(
                f"pp * virtual_stages = {self.pp} * {self.virtual_stages} = {chunks} is more "
                f"than {counted}: every model chunk needs at least one layer; use "
                f"pp * virtual_stages <= {total}")
        if total % chunks:
            raise ValueError(
                f"{counted} is not divisible by pp * virtual_stages = {self.pp} * "
                f"{self.virtual_stages} = {chunks}; every model chunk needs the same number "
                f"of layers")
        per = total // chunks
        out = [per] * chunks
        out[0] -= int(self.account_for_embedding_in_pipeline_split)
        out[-1] -= int(self.account_for_loss_in_pipeline_split)
        return tuple(out)

    @property
    def numerics(self) -> Precision:
        """The ``labsim.precision.Precision`` that ``precision`` names."""
        return training_precision(self.precision)

    @property
    def expert_tp(self) -> int:
        """GPUs each routed expert is split over: ``etp``, or ``tp`` when it is None."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_data_ranks(self) -> int:
        """GPUs that hold the same experts and reduce their gradients: ``tp cp dp / (ep
        etp)`` (``dp cp / ep`` with ``etp = tp``)."""
        return self.tp * self.gradient_ranks // (self.ep * self.expert_tp)

    @property
    def expert_load(self) -> float:
        """The busiest expert-parallel rank's routed rows over the balanced mean, after the
        capacity factor drops or pads them (``labsim.expert_parallel.expert_load``)."""
        return expert_load(self.expert_imbalance, self.capacity_factor, self.pad_to_capacity)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation element in compute precision."""
        return self.numerics.activation_bytes

    def validate_for(self, model: object, gpus: int | None = None) -> None:
        """Check the plan against a model (attributes ``layers``, ``heads``, ``kv_heads``) and,
        if given, the number of GPUs; raise ``ValueError`` naming the fix."""
        if not all(hasattr(model, a) for a in ("layers", "heads", "hidden")):
            raise ValueError(f"model must be a labsim.Transformer (e.g. labsim.Transformer."
                             f"preset('gpt3-175b')), got {type(model).__name__}")
        name = getattr(model, "name", "this model")
        if getattr(model, "experts", 0) and self.zero_stage == 3:
            raise ValueError(f"zero_stage=3 with {name}'s mixture-of-experts layers: the step "
                             "model gathers ZeRO-3 units of dense layers only; use zero_stage "
                             "<= 2")
        check_cp(model, self.cp, self.cp_comm, self.tp, self.attention)  # type: ignore[arg-type]
        for field, value in (("capacity_factor", self.capacity_factor), ("etp", self.etp)):
            if value is not None and not getattr(model, "experts", 0):
                raise ValueError(f"{field}={value:g} is about experts; {name} is dense: leave "
                                 f"{field} None")
        if getattr(model, "experts", 0) or self.ep > 1:
            check_ep(model, self.ep, self.tp, self.sequence_parallel,  # type: ignore[arg-type]
                     self.expert_tp)
        heads = int(model.heads)
        kv_heads = int(getattr(model, "kv_heads", None) or heads)
        layers = int(model.layers)
        if heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide heads={heads}: each TP rank needs whole "
                f"attention heads; choose tp among the divisors of {heads}"
            )
        if kv_heads % self.tp and self.tp % kv_heads:
            raise ValueError(
                f"tp={self.tp} and kv_heads={kv_heads}: one must divide the other so KV heads "
                f"are split or replicated evenly"
            )
        split = self.chunk_layers(layers)
        every = getattr(model, "moe_every", 1) if getattr(model, "experts", 0) else 1
        if any(n % every for n in split):
            raise ValueError(f"{name} alternates dense and MoE layers (moe_every={every}): "
                             f"every pipeline chunk must hold a multiple of {every} layers, "
                             f"not {split[:4]}...; choose pp and virtual stages so")
        if getattr(model, "experts", 0) and model.dense_layers > split[0]:
            raise ValueError(f"{name}'s {model.dense_layers} leading dense layers do not fit "
                             f"in the first of {len(split)} pipeline chunks ({split[0]} "
                             "layers): use fewer pipeline stages or virtual stages")
        if gpus is not None and self.gpus != gpus:
            rest = self.tp * self.pp * self.cp
            degrees = " * ".join(str(x) for x in (self.dp, self.tp, self.pp, self.cp)[
                :4 if self.cp > 1 else 3])
            raise ValueError(
                f"{self._product} = {degrees} = {self.gpus} but the "
                f"cluster has {gpus} GPUs; change dp to {gpus // rest}"
                if gpus % rest == 0
                else f"{self._product} = {self.gpus} but the cluster has {gpus} GPUs, and "
                f"{self._product.removeprefix('dp * ')} = {rest} does not divide {gpus}; "
                f"change {'tp, pp or cp' if self.cp > 1 else 'tp or pp'}"
            )
