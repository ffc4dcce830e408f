"""A communicator on a cluster, as NCCL sees it: ranks, nodes, ranks per node, NICs, and the
search graph NCCL's tuner reads (``Topology``).

``Group`` is built from a list of ranks (``group_of``) or, without listing them, from the
arithmetic layout a training plan uses (``strided_group``: ``size`` ranks ``stride`` apart, as
Megatron-LM lays out tensor-, data- and pipeline-parallel groups).  ``topology`` runs a
simplified version of NCCL's channel search (``src/graph/search.cc``, 2.30.7): the largest
per-channel speed of the architecture's speed array that the links carry, as many channels
as fit, kept if no slower speed gives more bandwidth in total; then ``ncclTopoDupChannels``
and the execution-channel doubling of ``connect.cc``.  It does not search real PCIe trees: a
node is a switch (NVSwitch or PCIe) with one port per GPU, and every GPU reaches its NIC
through one PCIe x16 link of its generation.  Where a cluster states the channels NCCL gave
its multi-node communicators (``Cluster.nccl_net_channels``, from a log), those replace the
search's for every group that spans nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from labsim.cluster import Cluster
from labsim.collectives.tuner import Topology

MAX_SEARCH_CHANNELS = 32  # MAXCHANNELS / 2 (device.h: MAXCHANNELS 64)
SPEEDS_INTRA = {
    "pre-sm90": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    "sm90": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    "sm100": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
SPEEDS_INTER = {
    "pre-sm90": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0,
                 3.0, 2.4, 1.2, 0.24, 0.12),
    "sm90": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4,
             1.2, 0.24, 0.12),
    "sm100": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0,
              12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}
# NVLS: 16 execution channels on SM90 (transport/nvls.cc); the NVLS graph has one head per GPU,
# and every head's channel crosses every GPU's NVLink, so a head runs at the fastest speed of
# the speed array at most the NVLink bandwidth over the heads: 40 GB/s on an H100 node, the
# speed at which NCCL's formula (tuning.cc:307-323) gives the ~480 GB/s all-reduce busbw NCCL's
# maintainers state for 8 H100 (nccl-tests issue #212).
NVLS_CHANNELS = {"hopper": 16, "blackwell": 32}


@dataclass(frozen=True)
class Group:
    """``nranks`` ranks of ``cluster`` on ``nnodes`` nodes, ``ppn`` on the fullest node, using
    ``nics`` distinct NICs on the node with fewest (the NICs nearest their GPUs)."""

    cluster: Cluster
    nranks: int
    nnodes: int
    ppn: int
    nics: int

    def __post_init__(self) -> None:
        if self.nranks < 1 or self.nnodes < 1 or self.ppn < 1 or self.nics < 1:
            raise ValueError(f"a group needs at least one rank, node and NIC, got {self!r}")

    @property
    def name(self) -> str:
        return (f"{self.nranks} ranks on {self.nnodes} node(s) of {self.cluster.name}"
                f" ({self.ppn} per node)")


def group_of(cluster: Cluster, ranks: Iterable[int] | int | None = None) -> Group:
    """The group of ``ranks`` (None: every GPU; an int n: ranks 0..n-1) of ``cluster``."""
    if ranks is None:
        ranks = range(cluster.world_size)
    elif isinstance(ranks, bool) or not isinstance(ranks, Iterable):
        n = _count("ranks", ranks)
        if n > cluster.world_size:
            raise ValueError(f"a group of {n} ranks on a {cluster.world_size}-GPU cluster; "
                             f"use at most {cluster.world_size}")
        ranks = range(n)
    members = [_rank(cluster, r) for r in ranks]
    if not members:
        raise ValueError("a collective needs at least one rank; pass a non-empty list")
    if len(set(members)) != len(members):
        raise ValueError(f"ranks must be distinct, got {sorted(members)[:16]}...")
    by_node: dict[int, set[int]] = {}
    for r in members:
        by_node.setdefault(r // cluster.gpus_per_node, set()).add(r % cluster.gpus_per_node)
    nics = min(len({cluster.nic_of(local) for local in loc}) for loc in by_node.values())
    return Group(cluster, len(members), len(by_node), max(map(len, by_node.values())), nics)


def strided_group(cluster: Cluster, size: int, stride: int, first: int = 0) -> Group:
    """``size`` ranks ``first, first + stride, ...`` without listing them (O(1) for any size):
    Megatron-LM's tensor-parallel (stride 1), data-parallel (stride tp) and pipeline (stride
    tp * dp) groups."""
    size, stride = _count("size", size), _count("stride", stride)
    g = cluster.gpus_per_node
    if first + (size - 1) * stride >= cluster.world_size:
        raise ValueError(f"a group of {size} ranks {stride} apart from rank {first} needs "
                         f"{first + (size - 1) * stride + 1} GPUs; the cluster has "
                         f"{cluster.world_size}")
    if size <= 64 or (stride < g and g % stride) or (stride >= g and stride % g):
        return group_of(cluster, range(first, first + size * stride, stride))
    if stride >= g:  # one rank per node
        return Group(cluster, size, size, 1, 1)
    ppn = min(size, g // stride)
    local = [(first % g) + i * stride for i in range(ppn)]
    nics = len({cluster.nic_of(x) for x in local})
    return Group(cluster, size, math.ceil(size / ppn), ppn, nics)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(value)


def _rank(cluster: Cluster, r: object) -> int:
    if isinstance(r, bool) or not isinstance(r, int):
        raise ValueError(f"ranks must be whole numbers, got {r!r}")
    cluster.node_of(r)  # range check
    return int(r)


def _speeds(cc: float, inter: bool) -> tuple[float, ...]:
    key = "sm100" if cc >= 10 else "sm90" if cc >= 9 else "pre-sm90"
    return (SPEEDS_INTER if inter else SPEEDS_INTRA)[key]


def _search(speeds: tuple[float, ...], max_bw: float, fit: object) -> tuple[int, float]:
    """Best channels x speed: start at the fastest speed <= ``max_bw``, go slower while a
    speed is more than 0.49 of the first one found, keep the most total bandwidth."""
    best = (0, 0.0)
    first = None
    for s in speeds:
        if s > max_bw + 1e-9:
            continue
        if first is not None and s / first <= .49:
            break
        n = min(MAX_SEARCH_CHANNELS, fit(s))  # type: ignore[operator]
        if n >= 1:
            first = first or s
            if n * s > best[0] * best[1] + 1e-9:
                best = (n, s)
    return best if best[0] else (1, speeds[-1])


def topology(group: Group) -> Topology:
    """NCCL's view of ``group`` (``labsim.collectives.tuner.Topology``)."""
    c = group.cluster
    cc = c.gpu.compute_capability or 8.0
    intra = c.intra_node.nccl_Bps / 1e9
    nic = c.inter_node.nccl_Bps / 1e9
    kind = "nvlink" if c.intra_node.kind == "nvlink" else "pcie"
    nvls_inter = 0.0
    if group.nnodes == 1:
        nch, bw = _search(_speeds(cc, False), intra, lambda s: int(intra // s))
    else:
        host = c.gpu_nic_Bps / 1e9
        max_bw = min(host, nic, intra)
        nch, bw = _search(_speeds(cc, True), max_bw,
                          lambda s: min(group.nics * int(nic // s), int(intra // s)))
        # the NVLS graph: one channel per head, each head on its own NIC
        nvls_inter = _search(_speeds(cc, True), max_bw, lambda s: 1)[1]
    if bw >= 25.0 and not (cc > 8.0 and bw < 50.0 and nch > 4):  # ncclTopoDupChannels
        dup = min(2 * nch, MAX_SEARCH_CHANNELS)
        bw /= math.ceil(dup / nch)
        nch = dup
    channels = min(64, 2 * nch)
    if cc >= 9 and group.nnodes > 1 and bw > 45.0 and channels < 16:
        channels *= 2
    if group.nnodes > 1 and c.nccl_net_channels is not None:  # what the system showed
        channels = c.nccl_net_channels
        nch = max(1, min(nch, channels // 2))
    nvls = c.gpu.arch in NVLS_CHANNELS and kind == "nvlink" and c.gpus_per_node > 2 \
        and group.ppn > 1
    heads = min(32, group.ppn)
    nvls_bw = _search(_speeds(cc, False), intra / heads, lambda s: 1)[1] if nvls else 0.0
    return Topology(
        nranks=group.nranks, nnodes=group.nnodes, arch=c.gpu.arch, intra=kind,
        ring_channels=nch, bw_intra=bw, bw_inter=bw, channels=channels,
        nvls_heads=heads if nvls else 0, nvls_bw=nvls_bw,
        nvls_bw_inter=nvls_inter if nvls else 0.0,
        nvls_channels=NVLS_CHANNELS.get(c.gpu.arch, 16), nvswitch=kind == "nvlink",
        collnet=c.in_network_reduction, ll128_net=True)
