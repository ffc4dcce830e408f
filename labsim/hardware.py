"""The hardware catalog: GPUs and links, every number with its source.

Peaks are **dense** FLOP/s.  Vendor sheets often print the 2x "with sparsity" figure for
tensor cores (A100 "624 TFLOPS" FP16, H100 SXM "1979 TFLOPS" BF16); those are not what a
dense training GEMM can reach and are never stored here.

Links carry their line rate per direction and what NCCL really achieves on them for large
messages (``nccl_efficiency``), because a ring all-reduce never runs at line rate: NVLink
packets carry protocol headers and NCCL's kernels need a few percent of the time to reduce.

A link's ``latency_s`` is the alpha of the textbook alpha-beta model: the fixed cost of one
step of a collective over that link.  We take NCCL's own cost model (``src/graph/tuning.cc``,
table ``hwLat``, ring algorithm, Simple protocol): 3.4 us per step over NVLink, 5.7 us over PCIe,
14 us over the network.  The NCCL model of ``labsim.collectives.nccl`` uses the whole table (per
protocol and algorithm) and the link's ``kind`` (NCCL's hardware class: ``"nvlink"``,
``"pcie"`` or ``"net"``) and ``nccl_Bps`` (the bandwidth NCCL's topology search assigns to the
link: 20 GB/s per NVLink3 link, 20.6 per NVLink4 link, PCIe width x speed / 80, NIC speed / 8;
``src/graph/topo.h``, ``topo.cc``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")
LINK_KINDS = ("nvlink", "pcie", "net")


def _check_number(name: str, value: object) -> float:
    """``value`` as a finite float, or ValueError naming ``name`` (bools and strings refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(
            value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_positive(name: str, value: object) -> float:
    if _check_number(name, value) <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class GPU:
    """One accelerator.

    ``peak_flops`` maps a dtype key (see ``DTYPES``) to the dense peak in FLOP/s (OP/s for
    int8); a dtype the chip has no unit for is absent.  ``memory_bytes`` is HBM/GDDR capacity
    (decimal GB as the vendor states it), ``memory_bandwidth_Bps`` its bandwidth in bytes/s.
    The devices report more than the stated figure (``nvidia-smi``: 81,559 MiB, 85.5e9 B, on an
    H100 80GB; 81,920 MiB on an A100 80GB; PyTorch's ``total_memory`` 150.1e9 B on the course's
    H200 record, a "141 GB" part); the stated figure leaves that margin to what a step's memory
    model does not count (the CUDA context, NCCL buffers, allocator fragmentation).
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth_Bps: float
    source: str
    sram_bytes: float = 0.0  # on-chip shared memory + L1 per SM, summed over SMs
    notes: str = ""
    compute_capability: float | None = None  # SM version (8.0 A100, 9.0 H100); None: not NVIDIA
    tdp_W: float | None = None  # board power limit (TDP / TBP), watts; the cost model's draw
    tdp_source: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.peak_flops) - set(DTYPES)
        if unknown:
            raise ValueError(
                f"{self.name}: unknown dtype keys {sorted(unknown)}; use {DTYPES}"
            )
        for key, value in self.peak_flops.items():
            _check_positive(f"GPU {self.name}: peak_flops[{key!r}]", value)
        _check_positive(f"GPU {self.name}: memory size and bandwidth must be > 0; memory_bytes",
                        self.memory_bytes)
        _check_positive(f"GPU {self.name}: memory size and bandwidth must be > 0; "
                        "memory_bandwidth_Bps", self.memory_bandwidth_Bps)
        if self.tdp_W is not None:
            _check_positive(f"GPU {self.name}: tdp_W (board power in watts)", self.tdp_W)
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        # hashed once: every collective a step prices is looked up by its group's cluster
        object.__setattr__(self, "_hash", hash((
            self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes,
            self.memory_bandwidth_Bps, self.compute_capability)))

    def __hash__(self) -> int:  # peak_flops is a read-only mapping: hash the rest
        return self._hash

    @property
    def arch(self) -> str:
        """NCCL's architecture class of the tuner tables (``src/graph/tuning.cc``: by compute
        capability: volta < 8.0 <= ampere < 9.0 <= hopper < 10.0 <= blackwell)."""
        cc = self.compute_capability or 8.0
        return "volta" if cc < 8 else "ampere" if cc < 9 else "hopper" if cc < 10 else \
            "blackwell"

    def __reduce__(self) -> tuple:
        """Pickle by value (a mapping proxy cannot be pickled), e.g. to a worker process."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["peak_flops"] = dict(self.peak_flops)
        return (_gpu_from_fields, (values,))

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; ValueError if the chip has no such unit."""
        if not isinstance(dtype, str):
            raise ValueError(f"dtype must be a name such as 'bf16', got {dtype!r}")
        key = dtype.lower()
        if key not in self.peak_flops:
            raise ValueError(
                f"{self.name} has no {dtype} peak in the catalog; it has "
                f"{', '.join(self.peak_flops)}"
            )
        return self.peak_flops[key]

    def ridge_point(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns compute-bound."""
        return self.peak(dtype) / self.memory_bandwidth_Bps


def _gpu_from_fields(values: dict) -> GPU:
    return GPU(**values)


@dataclass(frozen=True)
class Link:
    """A GPU-to-GPU or node-to-node link in the alpha-beta model.

    ``bandwidth_Bps`` is the line rate per direction, per GPU (NVLink: all links of one GPU
    together; PCIe: one x16 slot; InfiniBand: one NIC port).  ``latency_s`` is the alpha term
    of one message.  ``nccl_efficiency`` is the fraction of ``bandwidth_Bps`` that NCCL's ring
    achieves for large messages, measured where a source gives it.  ``nccl_channel_Bps`` (NICs
    only; None: no such limit) is what one NCCL channel moves through a NIC of this kind per
    direction when NCCL's network transport, not the port, is the limit: a communicator's
    traffic over the network then runs at most at its channels times this rate.
    """

    name: str
    bandwidth_Bps: float
    latency_s: float
    source: str
    nccl_efficiency: float = 1.0
    efficiency_source: str = "line rate (no published NCCL figure)"
    kind: str = "net"  # NCCL's hardware class: "nvlink", "pcie" or "net"
    nccl_Bps: float | None = None  # what NCCL's topology assigns (default: the line rate)
    nccl_channel_Bps: float | None = None  # one channel's rate through a NIC (None: no limit)

    def __post_init__(self) -> None:
        _check_positive(f"link {self.name}: bandwidth_Bps", self.bandwidth_Bps)
        _check_number(f"link {self.name}: latency_s", self.latency_s)
        if self.latency_s < 0:
            raise ValueError(f"link {self.name}: latency_s must be >= 0, got {self.latency_s!r}")
        _check_number(f"link {self.name}: nccl_efficiency", self.nccl_efficiency)
        if not 0 < self.nccl_efficiency <= 1:
            raise ValueError(f"link {self.name}: nccl_efficiency must be in (0, 1], got "
                             f"{self.nccl_efficiency!r}")
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link {self.name}: kind={self.kind!r}; choose one of {LINK_KINDS}")
        if self.nccl_Bps is None:
            object.__setattr__(self, "nccl_Bps", float(self.bandwidth_Bps))
        _check_positive(f"link {self.name}: nccl_Bps", self.nccl_Bps)
        if self.nccl_channel_Bps is not None:
            _check_positive(f"link {self.name}: nccl_channel_Bps", self.nccl_channel_Bps)
            if self.kind != "net":
                raise ValueError(f"link {self.name}: nccl_channel_Bps is a NIC's limit (kind "
                                 f"'net'); this link is kind {self.kind!r}, so leave it None")

    @property
    def achieved_Bps(self) -> float:
        """Bandwidth per direction that NCCL reaches for large messages."""
        return self.bandwidth_Bps * self.nccl_efficiency


T = 1e12
_GPUS: tuple[GPU, ...] = (
    GPU(
        "V100-32GB",
        {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T},
        32e9,
        900e9,
        "NVIDIA V100 datasheet (SXM2): 125 TFLOPS tensor FP16, 15.7 FP32, 900 GB/s HBM2",
        sram_bytes=80 * 128e3,
        compute_capability=7.0,
        tdp_W=300,
        tdp_source="NVIDIA Tesla V100 datasheet: max power consumption 300 W (SXM2; PCIe 250 W)",
    ),
    GPU(
        "A100-40GB",
        {
            "fp64": 9.7 * T,
            "fp32": 19.5 * T,
            "tf32": 156 * T,
            "fp16": 312 * T,
            "bf16": 312 * T,
            "int8": 624 * T,
        },
        40e9,
        1555e9,
        "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS BF16/FP16 dense (624 with sparsity), "
        "1,555 GB/s HBM2",
        sram_bytes=108 * 192e3,
        compute_capability=8.0,
        tdp_W=400,
        tdp_source="NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): max TDP "
                   "400 W (SXM4; PCIe 250-300 W)",
    ),
    GPU(
        "A100-80GB",
        {
            "fp64": 9.7 * T,
            "fp32": 19.5 * T,
            "tf32": 156 * T,
            "fp16": 312 * T,
            "bf16": 312 * T,
            "int8": 624 * T,
        },
        80e9,
        2039e9,
        "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16/FP16 dense (624 with sparsity), "
        "2,039 GB/s HBM2e",
        sram_bytes=108 * 192e3,
        compute_capability=8.0,
        tdp_W=400,
        tdp_source="NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): max TDP "
                   "400 W (SXM4 80GB)",
    ),
    GPU(
        "H100-SXM",
        {
            "fp64": 33.5 * T,
            "fp32": 66.9 * T,
            "tf32": 494.7 * T,
            "fp16": 989.4 * T,
            "bf16": 989.4 * T,
            "fp8": 1978.9 * T,
            "int8": 1978.9 * T,
        },
        80e9,
        3.35e12,
        "NVIDIA H100 datasheet (SXM5): BF16 1,979 TFLOPS with sparsity = 989.4 dense, "
        "3.35 TB/s HBM3",
        sram_bytes=132 * 256e3,
        compute_capability=9.0,
        tdp_W=700,
        tdp_source="NVIDIA H100 datasheet: max TDP up to 700 W, configurable (SXM5)",
    ),
    GPU(
        "H100-PCIe",
        {
            "fp64": 25.6 * T,
            "fp32": 51.2 * T,
            "tf32": 378 * T,
            "fp16": 756 * T,
            "bf16": 756 * T,
            "fp8": 1513 * T,
            "int8": 1513 * T,
        },
        80e9,
        2.0e12,
        "NVIDIA H100 datasheet (PCIe): BF16 1,513 TFLOPS with sparsity = 756 dense, 2 TB/s HBM2e",
        sram_bytes=114 * 256e3,
        compute_capability=9.0,
        tdp_W=350,
        tdp_source="NVIDIA H100 PCIe product brief PB-11133-001_v02: maximum TDP 350 W",
    ),
    GPU(
        "H200",
        {
            "fp64": 33.5 * T,
            "fp32": 66.9 * T,
            "tf32": 494.7 * T,
            "fp16": 989.4 * T,
            "bf16": 989.4 * T,
            "fp8": 1978.9 * T,
            "int8": 1978.9 * T,
        },
        141e9,
        4.8e12,
        "NVIDIA H200 datasheet (SXM): same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s",
        sram_bytes=132 * 256e3,
        compute_capability=9.0,
        tdp_W=700,
        tdp_source="NVIDIA H200 datasheet: max TDP up to 700 W, configurable (SXM)",
    ),
    GPU(
        "MI250X",
        {
            "fp64": 47.9 * T,
            "fp32": 47.9 * T,
            "fp16": 383 * T,
            "bf16": 383 * T,
            "int8": 383 * T,
        },
        128e9,
        3.2768e12,
        "AMD Instinct MI250X datasheet: 383 TFLOPS FP16/BF16 matrix, 47.9 TFLOPS FP32 vector "
        "(95.7 FP32 *matrix*), 128 GB HBM2e, 3.2768 TB/s",
        notes="fp32 is the vector rate; the 95.7 TFLOP/s figure is the FP32 matrix-core rate",
        tdp_W=560,
        tdp_source="AMD Instinct MI250X data sheet: total board power 500 W, 560 W peak (OAM); "
                   "the peak is used",
    ),
    GPU(
        "RTX-4090",
        {
            "fp32": 82.6 * T,
            "tf32": 82.6 * T,
            "fp16": 165.2 * T,
            "bf16": 165.2 * T,
            "fp8": 330.3 * T,
            "int8": 660.6 * T,
        },
        24e9,
        1008e9,
        "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): FP16/BF16 tensor 165.2 TFLOPS "
        "dense with FP32 accumulate (330.3 with FP16 accumulate), 82.6 FP32, 24 GB GDDR6X, "
        "1,008 GB/s",
        sram_bytes=128 * 128e3,
        compute_capability=8.9,
        tdp_W=450,
        tdp_source="NVIDIA GeForce RTX 4090 specifications: total graphics power 450 W",
    ),
    GPU(
        "A6000",
        {
            "fp32": 38.7 * T,
            "tf32": 77.4 * T,
            "fp16": 154.8 * T,
            "bf16": 154.8 * T,
            "int8": 309.7 * T,
        },
        48e9,
        768e9,
        "NVIDIA RTX A6000 datasheet: 38.7 TFLOPS FP32, tensor 309.7 TFLOPS with sparsity = "
        "154.8 dense FP16/BF16, 48 GB GDDR6, 768 GB/s",
        sram_bytes=84 * 128e3,
        compute_capability=8.6,
        tdp_W=300,
        tdp_source="NVIDIA RTX A6000 datasheet: max power consumption 300 W",
    ),
)

G = 1e9
# NCCL src/graph/tuning.cc, hwLat[hw][RING][SIMPLE]: per-step latency of a ring step, in s.
# ``nccl_Bps``: NCCL's topology bandwidth (src/graph/topo.h): NVLink SM70/SM80 20 GB/s and SM90
# 20.6 GB/s per link times the links; PCIe width x speed / 80 (Gen3 x16 12, Gen4 24, Gen5 48);
# a NIC its speed in Mb/s / 8000.
_NCCL_RING_LAT_NVLINK = 3.4e-6
_NCCL_RING_LAT_PCI = 5.7e-6
_NCCL_RING_LAT_NET = 14e-6
_LINKS: tuple[Link, ...] = (
    Link(
        "nvlink2",
        150 * G,
        _NCCL_RING_LAT_NVLINK,
        "V100 SXM2: 6 NVLink2 links x 25 GB/s per direction (NVIDIA V100 datasheet: 300 GB/s "
        "bidirectional)",
        nccl_efficiency=120 / 150,
        efficiency_source="NCCL's own topology bandwidth (6 links x SM70_NVLINK_BW 20 GB/s, "
        "src/graph/topo.h); no nccl-tests figure",
        kind="nvlink", nccl_Bps=6 * 20 * G,
    ),
    Link(
        "nvlink3",
        300 * G,
        _NCCL_RING_LAT_NVLINK,
        "A100 SXM4: 12 NVLink3 links x 25 GB/s = 300 GB/s per direction (600 GB/s "
        "bidirectional, NVIDIA A100 datasheet)",
        nccl_efficiency=230 / 300,
        efficiency_source="NCCL maintainers (nccl-tests issues): ~230 GB/s all-reduce busbw "
        "on an 8xA100 NVLink node for >= 8 GB messages",
        kind="nvlink", nccl_Bps=12 * 20 * G,
    ),
    Link(
        "nvlink4",
        450 * G,
        _NCCL_RING_LAT_NVLINK,
        "H100 SXM5: 18 NVLink4 links x 25 GB/s = 450 GB/s per direction (900 GB/s "
        "bidirectional, NVIDIA H100 datasheet)",
        nccl_efficiency=370 / 450,
        efficiency_source="NCCL maintainers (nccl-tests issues): ~370 GB/s ring all-reduce "
        "busbw on an 8xH100 NVLink node (~20 % protocol overhead)",
        kind="nvlink", nccl_Bps=18 * 20.6 * G,
    ),
    Link(
        "pcie3-x16",
        15.75 * G,
        _NCCL_RING_LAT_PCI,
        "PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 encoding = 15.75 GB/s per direction",
        nccl_efficiency=12 / 15.75,
        efficiency_source="NCCL's own topology bandwidth for the slot (src/graph/topo.cc: width x "
        "speed / 80 = 12 GB/s): PCIe's TLP and flow-control overhead; no nccl-tests figure",
        kind="pcie", nccl_Bps=12 * G,
    ),
    Link(
        "pcie4-x16",
        31.5 * G,
        _NCCL_RING_LAT_PCI,
        "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding = 31.5 GB/s per direction",
        nccl_efficiency=24 / 31.5,
        efficiency_source="NCCL's own topology bandwidth for the slot (src/graph/topo.cc: width x "
        "speed / 80 = 24 GB/s): PCIe's TLP and flow-control overhead; no nccl-tests figure",
        kind="pcie", nccl_Bps=24 * G,
    ),
    Link(
        "pcie5-x16",
        63 * G,
        _NCCL_RING_LAT_PCI,
        "PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 encoding = 63 GB/s per direction",
        nccl_efficiency=48 / 63,
        efficiency_source="NCCL's own topology bandwidth for the slot (src/graph/topo.cc: width x "
        "speed / 80 = 48 GB/s): PCIe's TLP and flow-control overhead; no nccl-tests figure",
        kind="pcie", nccl_Bps=48 * G,
    ),
    Link(
        "ib-hdr",
        25 * G,
        _NCCL_RING_LAT_NET,
        "InfiniBand HDR: 200 Gb/s = 25 GB/s per port per direction",
        nccl_efficiency=47 / 50,
        efficiency_source="assumed equal to NDR's measured fraction (46-48 of 50 GB/s)",
        kind="net", nccl_Bps=25 * G,
    ),
    Link(
        "opa-100",
        12.5 * G,
        _NCCL_RING_LAT_NET,
        "Intel Omni-Path Architecture 100: 100 Gb/s = 12.5 GB/s per port per direction",
        nccl_efficiency=47 / 50,
        efficiency_source="port: assumed equal to InfiniBand NDR's measured fraction (46-48 "
        "of 50 GB/s). Channel: 2.54 GB/s, fitted to BigScience's all-reduce of 4 GB on 4 "
        "Jean Zay nodes of 8 A100 (bigscience experiments/bandwidth, Jan 2022, NCCL 2.10.3 "
        "through IB verbs on hfi1, no GPUDirect RDMA): 1.529 s on 2 channels, busbw 5.07 GB/s, "
        "40 % of one port; 4 V100 nodes on 4 channels reached 10.6 GB/s, so the channel, not "
        "the port, is the limit",
        kind="net", nccl_Bps=12.5 * G, nccl_channel_Bps=2.54 * G,
    ),
    Link(
        "ib-ndr",
        50 * G,
        _NCCL_RING_LAT_NET,
        "InfiniBand NDR: 400 Gb/s = 50 GB/s per port per direction",
        nccl_efficiency=47 / 50,
        efficiency_source="NCCL maintainers (nccl-tests issues): 46-48 GB/s busbw per "
        "400 Gb/s NIC",
        kind="net", nccl_Bps=50 * G,
    ),
)


def _index(items: tuple) -> Mapping[str, object]:
    return MappingProxyType({item.name.lower(): item for item in items})


GPUS: Mapping[str, GPU] = _index(_GPUS)  # read-only views: no mutable module state
LINKS: Mapping[str, Link] = _index(_LINKS)


def _lookup(kind: str, table: Mapping[str, object], name: object) -> object:
    try:
        return table[str(name).lower()]
    except KeyError:
        names = ", ".join(item.name for item in table.values())  # type: ignore[attr-defined]
        raise ValueError(f"unknown {kind} {name!r}; the catalog has: {names}") from None


def gpu(name: str | GPU) -> GPU:
    """Look up a GPU by name (case-insensitive); a ``GPU`` passes through unchanged."""
    return name if isinstance(name, GPU) else _lookup("GPU", GPUS, name)  # type: ignore


def link(name: str | Link) -> Link:
    """Look up a link by name (case-insensitive); a ``Link`` passes through unchanged."""
    return name if isinstance(name, Link) else _lookup("link", LINKS, name)  # type: ignore
