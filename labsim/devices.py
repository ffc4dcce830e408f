"""What a GPU and a link are: the records of the hardware catalog (``labsim.hardware``).

A ``GPU`` holds its dense peaks per dtype, memory, HBM bandwidth, on-chip SRAM, compute
capability and power, each with its datasheet; a ``Link`` its line rate per direction,
what NCCL achieves on it and NCCL's own view of it (``labsim.hardware``'s module doc).
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

