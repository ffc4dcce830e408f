"""Published measurements the simulator is judged by, as package data with their sources.

* ``nccl_tests()``: nccl-tests curves (time or busbw against message size) of DGX-class
  A100 and H100 nodes and InfiniBand clusters, and BigScience's all-reduce timings on Jean
  Zay's Omni-Path (``labsim/data/nccl_tests.json``); each curve
  has a ``role``: ``"calibration"`` (the collective model's constants are fitted to it) or
  ``"validation"`` (never fitted to);
* ``alltoall_curves()``: nccl-tests ``alltoall_perf`` curves of the same sources (A100 and
  H100 nodes, H100 over InfiniBand up to 10 nodes), role ``"validation"`` only;
* ``predict_curve(curve)``: the NCCL model's times for a curve's sizes, on the curve's system
  and in its launch mode;
* ``runs()``: published training runs (``labsim/data/published_runs.json``): source, layout,
  batch, software stack, measured throughput; ``role`` ``"calibration"`` (a software
  profile's fitted value, ``SoftwareProfile.fitted``, is fitted to it) or ``"held-out"``
  (never fitted to);
* ``sweep_runs()``: MosaicML llm-foundry's whole benchmark sweep of MPT models under FSDP
  (``labsim/data/llmfoundry_sweep.json``, 125M-70B, 512-65k tokens, 8-512 GPUs, A100 and
  H100), role ``"sweep"``: a validation set of the ``fsdp`` profile over the whole range.

Every number in the data files was copied from the source named beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from labsim.cluster import Cluster
from labsim.collectives.bandwidth import busbw_factor
from labsim.collectives.group import group_of
from labsim.collectives.nccl import PHYSICS, NcclPhysics, plan_collective
from labsim.plan import Plan
from labsim.workload import Transformer

# nccl-tests -g 8: one thread launches the 8 GPUs' kernels of every call, which adds to each
# call's time (fitted with the collective constants, on the single-process calibration curve).
# nccl-tests times back-to-back launches, so in principle the launch is a floor, not an addend;
# the curves do not favour the floor (docs/step.md, "What was tried").
SINGLE_PROCESS_OVERHEAD_S = 12.2e-6
SYSTEMS = {
    "dgx-a100": lambda n: Cluster("A100-80GB", n, 8, "nvlink3", "ib-hdr", name=f"DGX A100 x{n}"),
    "dgx-h100": lambda n: Cluster("H100-SXM", n, 8, "nvlink4", "ib-ndr", name=f"DGX H100 x{n}"),
    "dgx-h200": lambda n: Cluster("H200", n, 8, "nvlink4", "ib-ndr", name=f"8 x H200 x{n}"),
    "dgx-h100-sharp": lambda n: Cluster("H100-SXM", n, 8, "nvlink4", "ib-ndr",
                                        name=f"DGX H100 x{n}, SHARP",
                                        in_network_reduction=True),
    # IDRIS Jean Zay: 4 Omni-Path 100 links a node; NCCL gave the all-reduce of every GPU
    # 2 channels on the A100 nodes and 4 on the V100 nodes (the logs' "N coll channels")
    "jean-zay-a100": lambda n: Cluster("A100-80GB", n, 8, "nvlink3", "opa-100", 4,
                                       name=f"Jean Zay A100 x{n}", nccl_net_channels=2),
    "jean-zay-v100": lambda n: Cluster("V100-32GB", n, 4, "nvlink2", "opa-100", 4,
                                       name=f"Jean Zay V100 x{n}", nccl_net_channels=4),
}


@dataclass(frozen=True)
class Curve:
    """One published nccl-tests run: ``points`` are (bytes, time in s or None, busbw in B/s
    or None); ``launch`` is ``"per-gpu"`` (one process per GPU, mpirun) or
    ``"single-process"`` (``-g 8``)."""

    id: str
    system: str
    nodes: int
    gpus: int
    op: str
    launch: str
    algorithm: str
    role: str
    nccl: str
    source: str
    url: str | None
    notes: str
    points: tuple[tuple[int, float | None, float | None], ...]

    @property
    def cluster(self) -> Cluster:
        return SYSTEMS[self.system](self.nodes)

    def measured_s(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of every point (time from busbw where only busbw is printed)."""
        out = []
        for size, t, bus in self.points:
            if t is not None:
                out.append((size, t))
            elif bus:
                out.append((size, size * busbw_factor(self.op, self.gpus) / bus))
        return out


@lru_cache(maxsize=1)
def nccl_tests() -> tuple[Curve, ...]:
    """The published nccl-tests curves of the collectives shipped with labsim."""
    return _curves("datasets")


@lru_cache(maxsize=1)
def alltoall_curves() -> tuple[Curve, ...]:
    """The published nccl-tests ``alltoall_perf`` curves (grouped send/recv, every one of
    role ``"validation"``), apart from ``nccl_tests()``: nothing is fitted to them."""
    return _curves("p2p_datasets")


def _curves(key: str) -> tuple[Curve, ...]:
    text = resources.files("labsim").joinpath("data/nccl_tests.json").read_text("utf-8")
    curves = []
    for d in json.loads(text)[key]:
        pts = tuple((int(s), None if t is None else t * 1e-6, None if b is None else b * 1e9)
                    for s, t, b in d["points"])
        curves.append(Curve(d["id"], d["system"], d["nodes"], d["gpus"], d["op"], d["launch"],
                            d["algorithm"], d["role"], d["nccl"], d["source"], d["url"],
                            d["notes"], pts))
    return tuple(curves)


def predict_curve(curve: Curve, physics: NcclPhysics = PHYSICS,
                  single_process_s: float = SINGLE_PROCESS_OVERHEAD_S,
                  ) -> list[tuple[int, float, float, str]]:
    """(bytes, measured s, predicted s, "algorithm/protocol") for every point of ``curve``."""
    group = group_of(curve.cluster)
    out = []
    for size, measured in curve.measured_s():
        cost = plan_collective(curve.op, size, group, curve.algorithm, physics=physics)
        t = cost.time_s + (single_process_s if curve.launch == "single-process" else 0.0)
        out.append((size, measured, t, f"{cost.algorithm}/{cost.protocol}"))
    return out


# The NVLink of the 8-GPU NVSwitch node (HGX / DGX board) each GPU of a published run sits in:
# its generation and link count (H800: 8 NVLink4 links, not H100's 18).  PCIe parts (H100 PCIe,
# H100 NVL's bridged pairs) have no such node and are refused.
NODE_NVLINK = {"V100-32GB": "nvlink2", "A100-40GB": "nvlink3", "A100-80GB": "nvlink3",
               "H100-SXM": "nvlink4", "H100-SXM-HBM2e": "nvlink4", "H200": "nvlink4",
               "H800": "nvlink4-h800", "B200": "nvlink5"}


@dataclass(frozen=True)
class Run:
    """One published training run: its source, its layout as a labsim ``plan`` (keyword
    arguments of ``labsim.Plan``), its ``model`` fields, the GPUs it ran on and what was
    measured; ``role`` is ``"calibration"`` (a software profile's fitted value is fitted to
    it) or ``"held-out"`` (never fitted to); ``notes`` lists every assumption added."""

    id: str
    role: str
    gpu: str
    gpus: int
    fabric: str
    model_spec: dict
    plan_spec: dict
    measured: dict
    stack: str
    source: str
    url: str
    location: str
    quote: str
    notes: tuple[str, ...]
    nics_per_node: int | None = None  # None: one NIC per GPU
    nccl_net_channels: int | None = None  # as NCCL_DEBUG=INFO showed it; None: the search

    @property
    def model(self) -> Transformer:
        m = dict(self.model_spec)
        family = m.pop("family")
        if family == "llama":
            return Transformer(**m, swiglu=True, positions="rotary", norm="rmsnorm",
                               bias=False, dropout=False)
        if family == "mpt":  # ALiBi (no position parameters), no biases, tied, no dropout
            m.pop("kv_heads")
            return Transformer(**m, positions="rotary", bias=False, dropout=False,
                               tied_embeddings=True)
        if family == "bloom":  # GPT with ALiBi (no position parameters), tied, dropout
            return Transformer(**m, positions="rotary", tied_embeddings=True)
        if family == "nemotron":  # squared-ReLU MLP of two matrices, RoPE, GQA, untied
            return Transformer(**m, positions="rotary", bias=False, dropout=False)
        return Transformer(**m, tied_embeddings=True)

    @property
    def cluster(self) -> Cluster:
        nodes, per = max(1, self.gpus // 8), min(8, self.gpus)
        if self.gpu not in NODE_NVLINK:
            raise ValueError(f"run {self.id}: no 8-GPU NVSwitch node known for {self.gpu!r}; "
                             f"published runs use one of {', '.join(NODE_NVLINK)}")
        intra = NODE_NVLINK[self.gpu]
        return Cluster(self.gpu, nodes, per, intra, self.fabric, self.nics_per_node,
                       name=f"{self.gpus} x {self.gpu}",
                       nccl_net_channels=self.nccl_net_channels)

    @property
    def plan(self) -> Plan:
        return Plan(**self.plan_spec)

    def measured_step_s(self) -> float:
        """The measured step time: as printed, or from tokens/s per GPU, or from TFLOP/s per
        GPU with the run's FLOP count: PaLM's ``6 N + 12 L H Q T`` per token where
        ``measured["flops"]`` is ``"palm"`` (Chowdhery et al. 2022, Appendix B; N every
        parameter), else Narayanan et al. 2021's Eq. 3 (which counts recomputation)."""
        meas, model = self.measured, self.model
        if meas.get("step_time_s"):
            return float(meas["step_time_s"])
        tokens = self.plan_spec["global_batch"] * model.seq_len
        if meas.get("tokens_per_s_per_gpu"):
            return tokens / (meas["tokens_per_s_per_gpu"] * self.gpus)
        if meas.get("flops") == "palm":
            per_token = 6 * model.params + 12 * (model.layers * model.heads * model.head_dim
                                                 * model.seq_len)
            return per_token * tokens / (self.gpus * meas["tflops_per_gpu"] * 1e12)
        s, layers, h, v = model.seq_len, model.layers, model.hidden, model.vocab
        flops = 96 * self.plan_spec["global_batch"] * s * layers * h * h * (
            1 + s / (6 * h) + v / (16 * layers * h))
        return flops / (self.gpus * meas["tflops_per_gpu"] * 1e12)


# llm-foundry's GPU names, and the network assumed under them (the README: A100 nodes with
# "1600 Gbps node-node interconnect (RoCE)", 8 x 200 Gb/s like HDR InfiniBand; H100 not stated,
# DGX H100's 8 x NDR 400 Gb/s assumed as for the published H100 runs)
SWEEP_GPUS = {"a100_40gb": ("A100-40GB", "ib-hdr"), "a100_80gb": ("A100-80GB", "ib-hdr"),
              "h100_80gb": ("H100-SXM", "ib-ndr")}
SWEEP_PRECISIONS = {"amp_bf16": "autocast-bf16", "bf16": "bf16"}
# the A100 40GB table ran on PyTorch 1.13, the others on 2.1 (``labsim.software``, fsdp-torch1.13)
SWEEP_SOFTWARE = {"a100_40gb": "fsdp-torch1.13", "a100_80gb": "fsdp", "h100_80gb": "fsdp"}


@lru_cache(maxsize=1)
def sweep_runs() -> tuple[Run, ...]:
    """llm-foundry's benchmark sweep as runs of role ``"sweep"`` (module doc): every BF16 row
    with FULL_SHARD sharding and no activation offload whose global batch is a whole number
    of micro-batches per GPU (Composer also runs uneven last micro-batches, which a ``Plan``
    does not express)."""
    text = resources.files("labsim").joinpath("data/llmfoundry_sweep.json").read_text("utf-8")
    data = json.loads(text)
    out = []
    for table in data["tables"]:
        for row in table["rows"]:
            get = dict(zip(data["columns"], row)).__getitem__
            size, seq, gpus = get("Model"), int(get("SeqLen (T)")), int(get("# GPUs"))
            mbs, batch = int(get("MicroBatchSize")), int(get("GlobalBatchSize"))
            if (get("Precision") not in SWEEP_PRECISIONS
                    or get("Sharding Strategy") != "FULL_SHARD"
                    or get("Activation CPUOffload") != "False" or batch % (mbs * gpus)):
                continue
            gpu, fabric = SWEEP_GPUS[get("GPU")]
            dims = data["models"][size]
            model = dict(dims, family="mpt", kv_heads=dims["heads"], seq_len=seq,
                         name=f"MPT-{size}")
            plan = dict(dp=gpus, micro_batch=mbs, global_batch=batch, zero_stage=3,
                        recompute="full" if get("Activation Checkpointing") == "True"
                        else "none", precision=SWEEP_PRECISIONS[get("Precision")],
                        software=SWEEP_SOFTWARE[get("GPU")])
            measured = {"tokens_per_s_per_gpu": float(get("Throughput (T/s/GPU)")),
                        "mfu_pct": float(get("MFU"))}
            run_id = f"llmfoundry_sweep_{get('GPU')}_{size}_seq{seq}_{gpus}gpu_mbs{mbs}"
            out.append(Run(run_id, "sweep", gpu, gpus, fabric, model, plan, measured,
                           "MosaicML llm-foundry / Composer (PyTorch FSDP)", data["source"],
                           data["url"], f"table '{table['name']}'", "| " + " | ".join(row)
                           + " |", ()))
    return tuple(out)


@lru_cache(maxsize=1)
def runs() -> tuple[Run, ...]:
    """The published training runs shipped with labsim (calibration and held-out)."""
    text = resources.files("labsim").joinpath("data/published_runs.json").read_text("utf-8")
    return tuple(Run(d["id"], d["role"], d["gpu"], d["gpus"], d["fabric"], d["model"],
                     d["plan"], d["measured"], d["stack"], d["source"], d["url"],
                     d["location"], d["quote"], tuple(d["notes"]), d.get("nics_per_node"),
                     d.get("nccl_net_channels"))
                 for d in json.loads(text)["runs"])
