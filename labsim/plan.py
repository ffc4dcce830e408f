"""``Plan``: how one training step is parallelised and executed.

A plan is the single contract between a model, a cluster and the step simulator
(``labsim.simulate_step``).  It says how the GPUs are split (data parallel ``dp`` x tensor
parallel ``tp`` x pipeline parallel ``pp``, the Megatron-LM "3D" layout of Narayanan et al. 2021),
how the global batch is cut into micro-batches, which pipeline schedule runs them, how much of
the model state ZeRO shards (Rajbhandari et al. 2020), what is recomputed in backward
(Korthikanti et al. 2022), and how gradients are reduced.

Checks that need only the plan happen here (``Plan(...)`` raises ``ValueError`` naming the fix);
checks against a model and a cluster (heads divisible by tp, layers by pp x virtual stages,
dp x tp x pp = GPUs) happen in ``Plan.validate_for`` which ``simulate_step`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from labsim.precision import Precision, training_precision

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "standard")


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
    zero_stage: 0 (plain DP), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
    recompute: ``"none"``, ``"selective"`` (attention core recomputed, Korthikanti et al. 2022)
        or ``"full"`` (each layer's forward recomputed from its input in backward).
    sequence_parallel: Megatron sequence parallelism (norms and dropout sharded over tp;
        all-reduces become reduce-scatter + all-gather of the same volume).
    precision: a name of ``labsim.precision.PRECISIONS``: ``"bf16"``/``"fp16"`` (mixed
        precision: 16-bit compute, fp32 master weights), ``"fp32"``, ``"mixed-fp32-grads"``
        (Megatron-LM's fp32 gradients), ``"autocast-bf16"`` (torch.amp), ``"pure-bf16"``...;
        ``numerics`` is the ``Precision`` it names (bytes and peak derive from it).
    overlap_grad_reduce: launch each gradient bucket's reduction as soon as its gradients are
        final, overlapping it with the rest of backward (PyTorch DDP); False = reduce all
        gradients after backward (Megatron's "local" DDP of 2021).
    bucket_bytes: gradient bucket size (PyTorch DDP default ``bucket_cap_mb=25``).
    attention: ``"flash"`` (fused FlashAttention kernel; no s x s tensor in HBM) or
        ``"standard"`` (batched GEMMs + fused softmax/dropout kernels over the s x s scores, as
        Megatron-LM ran in 2021).
    optimizer: ``"adam"``, ``"sgd"`` or ``"sgd-momentum"`` (memory and optimizer-step cost).
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
    overlap_grad_reduce: bool = True
    bucket_bytes: float = 25e6
    attention: str = "flash"
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.dp * self.micro_batch)
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch!r}: must be a positive integer")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by dp * micro_batch = "
                f"{self.dp} * {self.micro_batch} = {self.dp * self.micro_batch}; choose a "
                f"global batch that is a multiple of {self.dp * self.micro_batch}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: choose one of {SCHEDULES}")
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
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ValueError(
                f"the interleaved schedule needs the micro-batch count per replica "
                f"({self.microbatches}) to be a multiple of pp={self.pp} (Megatron-LM's "
                f"requirement); change global_batch or micro_batch"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r}: choose 0, 1, 2 or 3")
        if self.zero_stage >= 2 and self.pp > 1:
            raise ValueError(
                f"zero_stage={self.zero_stage} with pp={self.pp}: gradient and parameter "
                "sharding do not combine with pipeline parallelism (DeepSpeed's pipeline "
                "engine refuses ZeRO-2/3); use zero_stage <= 1 or pp = 1"
            )
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: choose one of {RECOMPUTE}")
        try:
            training_precision(self.precision)
        except ValueError as exc:
            raise ValueError(f"precision={self.precision!r}: {exc}") from None
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}: choose one of {ATTENTION}")
        if self.optimizer not in ("adam", "sgd", "sgd-momentum"):
            raise ValueError(
                f"optimizer={self.optimizer!r}: choose 'adam', 'sgd' or 'sgd-momentum'"
            )
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence_parallel needs tp > 1 (it shards over the TP group)")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={self.bucket_bytes!r}: must be > 0")

    @property
    def gpus(self) -> int:
        """GPUs the plan occupies: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    @property
    def microbatches(self) -> int:
        """Micro-batches per replica per step: global_batch / (dp * micro_batch)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def numerics(self) -> Precision:
        """The ``labsim.precision.Precision`` that ``precision`` names."""
        return training_precision(self.precision)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation element in compute precision."""
        return self.numerics.activation_bytes

    def validate_for(self, model: object, gpus: int | None = None) -> None:
        """Check the plan against a model (attributes ``layers``, ``heads``, ``kv_heads``) and,
        if given, the number of GPUs; raise ``ValueError`` naming the fix."""
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
        chunks = self.pp * self.virtual_stages
        if layers % chunks:
            raise ValueError(
                f"layers={layers} is not divisible by pp * virtual_stages = {self.pp} * "
                f"{self.virtual_stages} = {chunks}; every model chunk needs the same number "
                f"of layers"
            )
        if gpus is not None and self.gpus != gpus:
            raise ValueError(
                f"dp * tp * pp = {self.dp} * {self.tp} * {self.pp} = {self.gpus} but the "
                f"cluster has {gpus} GPUs; change dp to {gpus // (self.tp * self.pp)}"
                if gpus % (self.tp * self.pp) == 0
                else f"dp * tp * pp = {self.gpus} but the cluster has {gpus} GPUs, and "
                f"tp * pp = {self.tp * self.pp} does not divide {gpus}; change tp or pp"
            )
