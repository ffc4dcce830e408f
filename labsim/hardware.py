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
link: 20 GB/s per NVLink3 link, 20.6 per NVLink4 link, 40.1 per NVLink5 link, PCIe width x
speed / 80, NIC speed / 8;
``src/graph/topo.h``, ``topo.cc``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from labsim.catalog import CATALOG_GPUS, CATALOG_LINKS
from labsim.devices import DTYPES, GPU, LINK_KINDS, Link

__all__ = ["DTYPES", "GPU", "GPUS", "LINKS", "LINK_KINDS", "Link", "gpu", "link"]


def _index(items: tuple) -> Mapping[str, object]:
    return MappingProxyType({item.name.lower(): item for item in items})


GPUS: Mapping[str, GPU] = _index(CATALOG_GPUS)  # read-only views: no mutable module state
LINKS: Mapping[str, Link] = _index(CATALOG_LINKS)


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
