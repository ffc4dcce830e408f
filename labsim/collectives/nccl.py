"""The NCCL model of a collective: NCCL's choice, and what that choice physically costs.

``plan_collective(op, nbytes, group, algorithm, protocol)`` returns a ``CollectiveCost``:

1. **choice** -- the (algorithm, protocol) NCCL's own tuner picks for this size
   (``labsim.collectives.tuner``: Ring, Tree (double binary tree, pipelined), NVLS (NVLink
   SHARP), NVLS-Tree, CollNet (in-network reduction), PAT; LL, LL128, Simple), restricted like
   ``NCCL_ALGO`` / ``NCCL_PROTO`` when ``algorithm`` / ``protocol`` are given;
2. **latency** -- NCCL's latency of that choice (``baseLat`` + ``hwLat`` per hop by link
   class) times a factor per architecture and per protocol, plus the pipeline fill: the
   first chunk crosses the algorithm's depth before the bytes stream (ring: ``ring_fill``
   chunks; tree: ``tree_fill`` chunks per level of the inter-node tree plus one for the
   chain inside each node, which forwards data as it arrives; NVLS: per 2 MiB unit), each
   piece at its channel's own rate;
3. **bandwidth** -- the smallest of NCCL's bandwidth for the choice (channels x per-channel
   graph bandwidth with the protocol factors and caps), what the channels the call really
   uses carry at a channel's own rate (``channels_threads``: one channel per 32 KiB for
   Ring/Simple ...; ``NcclPhysics.channel_GBps``), and what the links carry: ``intra_load`` bytes on
   every member GPU's port and ``nic_load`` on every NIC the group uses, per byte of
   ``nbytes``, over the links' achieved bandwidth times the protocol's data fraction (LL 8 of
   16 bytes, LL128 120 of 128).

Alone on the network a collective takes ``latency_s + nbytes / bandwidth``
(``CollectiveCost.time_s``, the closed form); the simulator moves the same loads through
shared links, so the two agree exactly when nothing else runs.

The physical constants below are fitted once, by least squares on log time, to three
published nccl-tests curves (the calibration set of ``labsim.published``: 8 x A100, one
process per GPU; 8 x H100 with NVLS, one process per GPU; 4 x 8 H100 over InfiniBand NDR);
every other published curve is validation (``benchmarks/collectives.py`` prints both).  The
calibration set's fourth member, one all-reduce on Omni-Path, fits only that link's
``Link.nccl_channel_Bps``: where a NIC kind has one, a communicator's traffic across nodes
moves at most at its channels times that rate (a send: one channel, as NCCL 2.10 gives a
remote peer), the limit of a network transport slower than its ports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import MappingProxyType

from labsim.collectives.group import Group
from labsim.collectives.group import topology as _topology
from labsim.collectives.tuner import (
    ALGOS,
    PROTOS,
    Topology,
    bandwidth_GBps,
    channels_threads,
    estimate_us,
    log2i,
    parse_choice,
    select,
    supported_pairs,
)

NCCL_OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall",
            "sendrecv")
PROTOCOL_DATA = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}  # data bytes per wire byte
CHUNK_BYTES = {"LL": 32768.0, "LL128": 576000.0, "Simple": 2.0 * 2**20}  # per step, channel
NVLS_UNIT = 2.0 * 2**20


def _frozen(d: dict[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class NcclPhysics:
    """What NCCL's tuner tables leave out, fitted to the calibration curves
    (``benchmarks/collectives.py --fit`` repeats the fit and prints it):

    latency_scale: measured small-message time over NCCL's latency estimate, per GPU
        architecture (one process per GPU); ``protocol_latency`` multiplies it per protocol
        (LL, the protocol of the smallest calls, 1);
    channel_GBps: what one channel (one CUDA block) moves, per protocol, in NCCL's bandwidth
        units (GB/s per execution channel, before the protocol's factors), on an Ampere GPU;
        ``channel_scale`` per architecture multiplies it.  A call of few bytes runs on few
        channels (``channels_threads``), so its bandwidth is its channels' sum up to NCCL's
        bandwidth for the whole communicator.  A property of the GPU, not of the links:
        faster links never make a channel slower;
    ring_fill, tree_fill, nvls_fill: pipeline fill, in chunks of the protocol (for Tree per
        level: 1 + log2(nodes)), or 2 MiB pieces for NVLS.  The calibration chains are 7 GPUs
        long, so they cannot tell a fill per GPU of the chain from one per level; per level
        fits as well (the same loss) and does not make a hypothetical 128-GPU NVLink domain
        a 127-deep store-and-forward chain.
    """

    latency_scale: Mapping[str, float] = field(default_factory=lambda: _frozen(
        {"volta": 1.87, "ampere": 1.87, "hopper": 1.18, "blackwell": 1.18}))
    protocol_latency: Mapping[str, float] = field(default_factory=lambda: _frozen(
        {"LL": 1.0, "LL128": 0.884, "Simple": 1.03}))
    channel_GBps: Mapping[str, float] = field(default_factory=lambda: _frozen(
        {"LL": 47.8, "LL128": 16.7, "Simple": 16.9}))
    channel_scale: Mapping[str, float] = field(default_factory=lambda: _frozen(
        {"volta": 1.0, "ampere": 1.0, "hopper": 2.01, "blackwell": 2.01}))
    ring_fill: float = 1.75
    tree_fill: float = 2.36
    nvls_fill: float = 0.404

    def __hash__(self) -> int:
        return hash((tuple(self.latency_scale.items()), tuple(self.protocol_latency.items()),
                     tuple(self.channel_GBps.items()),
                     tuple(self.channel_scale.items()), self.ring_fill, self.tree_fill,
                     self.nvls_fill))

    def __reduce__(self) -> tuple:
        """Pickle by value (a mapping proxy cannot be pickled), e.g. to a worker process."""
        return (_physics, (dict(self.latency_scale), dict(self.protocol_latency),
                           dict(self.channel_GBps),
                           dict(self.channel_scale), self.ring_fill, self.tree_fill,
                           self.nvls_fill))

    def channel_rate_GBps(self, proto: str, topo: Topology) -> float:
        """What one execution channel of ``proto`` moves on ``topo`` (GB/s, NCCL's units)."""
        return self.channel_GBps[proto] * self.channel_scale[topo.arch]


def _physics(latency_scale: dict, protocol_latency: dict, channel_GBps: dict,
             channel_scale: dict, ring: float, tree: float, nvls: float) -> NcclPhysics:
    return NcclPhysics(_frozen(latency_scale), _frozen(protocol_latency), _frozen(channel_GBps),
                       _frozen(channel_scale), ring, tree, nvls)


PHYSICS = NcclPhysics()


@dataclass(frozen=True)
class CollectiveCost:
    """One collective as the network model moves it (times in s, bandwidths in bytes/s).

    ``latency_s``: time before and besides the bytes streaming (NCCL's latency, scaled, plus
    the pipeline fill); ``cap_Bps``: the most bytes of ``nbytes`` per second the chosen
    algorithm, protocol and channels can move; ``intra_load`` / ``nic_load``: wire bytes on
    every member GPU's port (each direction) / on every NIC the group uses, per byte of
    ``nbytes``, divided by the protocol's data fraction.  ``nccl_estimate_s`` is what NCCL's
    own tuner expects.
    """

    op: str
    nbytes: float
    group: Group
    algorithm: str
    protocol: str
    channels: int
    latency_s: float
    cap_Bps: float
    intra_load: float
    nic_load: float
    nccl_estimate_s: float

    @property
    def bandwidth_Bps(self) -> float:
        """Bytes of ``nbytes`` per second alone on the network."""
        c = self.group.cluster
        limits = [self.cap_Bps]
        if self.intra_load > 0:
            limits.append(c.intra_node.achieved_Bps / self.intra_load)
        if self.nic_load > 0:
            limits.append(c.inter_node.achieved_Bps / self.nic_load)
        return min(limits)

    @property
    def time_s(self) -> float:
        """Seconds alone on the network (the closed form)."""
        if self.nbytes == 0 or self.group.nranks == 1:
            return 0.0
        return self.latency_s + self.nbytes / self.bandwidth_Bps


def _func(op: str) -> str:
    return op if op in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce") \
        else "allgather"


@lru_cache(maxsize=4096)
def _topology_of(group: Group) -> Topology:
    return _topology(group)


def plan_collective(op: str, nbytes: float, group: Group, algorithm: str = "auto",
                    protocol: str = "auto", physics: NcclPhysics = PHYSICS) -> CollectiveCost:
    """What ``op`` of ``nbytes`` (nccl-tests size: the whole buffer; for all-gather the
    output, for reduce-scatter the input) costs on ``group`` under the NCCL model.

    A ``Group`` is a shape (ranks, nodes, GPUs per node, NICs on a cluster), not a rank list,
    so the answers are cached: a training step asks the same question for every stage."""
    try:
        return _plan_cached(op, nbytes, group, algorithm, protocol, physics)
    except TypeError:  # an unhashable argument: let the checks below name it
        return _plan(op, nbytes, group, algorithm, protocol, physics)


def _plan(op: str, nbytes: float, group: Group, algorithm: str, protocol: str,
          physics: NcclPhysics) -> CollectiveCost:
    if op not in NCCL_OPS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(NCCL_OPS)}")
    n = group.nranks
    topo = _topology_of(group)
    if n == 1 or nbytes == 0:
        return CollectiveCost(op, float(nbytes), group, "none", "none", 0, 0.0, math.inf, 0.0,
                              0.0, 0.0)
    if op in ("alltoall", "sendrecv"):
        return _p2p(op, float(nbytes), group, topo, physics)
    func = _func(op)
    algos = parse_choice(algorithm, ALGOS, "algo")
    protos = parse_choice(protocol, PROTOS, "proto")
    algo, proto, estimate = select(func, nbytes, topo, algos, protos)
    lat_us, algbw = next((lat, bw) for a, p, lat, bw in supported_pairs(func, topo)
                         if a == algo and p == proto)
    nc, _ = channels_threads(algo, proto, nbytes, topo)
    if algo.startswith("nvls"):  # a fixed set of NVLS channels, whatever the size
        channels_bw = algbw
    else:  # the call's own channels, each at a channel's rate (LL's ceiling caps the sum)
        rate = physics.channel_rate_GBps(proto, topo)
        channels_bw = bandwidth_GBps(func, algo, proto, topo, nc, rate, rate, ll_cap=False)
    intra, nic, depth, piece = _loads(func, algo, nbytes, group, nc, proto, physics)
    data = PROTOCOL_DATA[proto]
    channels_bw = min(channels_bw, _net_channels_GBps(group, nc, nic * group.nics / data))
    cap = min(algbw, channels_bw) * 1e9
    # the first piece of each channel crosses the pipeline at its channel's own speed: while
    # the pipeline fills, the links carry only the leading pieces
    fill = depth * piece / (channels_bw * 1e9 / nc)
    latency = (physics.latency_scale[topo.arch] * physics.protocol_latency[proto] * lat_us
               * 1e-6 + fill)
    return CollectiveCost(op, float(nbytes), group, algo, proto, nc, latency, cap,
                          intra / data, nic / data, estimate * 1e-6)


_plan_cached = lru_cache(maxsize=65536)(_plan)


def clear_cache() -> None:
    """Forget every answer ``plan_collective`` and NCCL's tuner keep, as a fresh process
    would (the benchmarks time a planner's first calls with it)."""
    _plan_cached.cache_clear()
    _topology_of.cache_clear()
    supported_pairs.cache_clear()


def _loads(func: str, algo: str, nbytes: float, group: Group, nc: int, proto: str,
           physics: NcclPhysics) -> tuple[float, float, float, float]:
    """(intra load, NIC load, fill depth, fill piece bytes per channel) of an algorithm."""
    n, nn, ppn, nics = group.nranks, group.nnodes, group.nranks / group.nnodes, group.nics
    steps = 2 * (n - 1) if func == "allreduce" else n - 1 if func in (
        "allgather", "reduce_scatter") else n
    fac = steps / n  # wire bytes per rank per byte, as a ring moves them
    chunk = CHUNK_BYTES[proto]
    if algo in ("ring", "pat"):
        intra = fac * (1 - 1 / ppn) if nn > 1 else fac
        nic = fac / nics if nn > 1 else 0.0
        return intra, nic, physics.ring_fill, min(nbytes / (nc * n), chunk)
    tree_nic = (2.0 if nn > 2 else 1.0) / nics if nn > 1 else 0.0
    levels = 1 + log2i(nn)  # the chain inside a node, then the inter-node tree
    if algo == "tree":
        return (2.0 if ppn > 1 else 0.0), tree_nic, physics.tree_fill * levels, min(
            nbytes / (2 * nc), chunk)
    if algo in ("nvls", "nvls_tree"):
        intra = 1.0 if func == "allreduce" else (n - 1) / n
        nic = tree_nic if algo == "nvls_tree" else (1.0 / nics if nn > 1 else 0.0)
        return intra, nic, physics.nvls_fill, min(nbytes / nc, NVLS_UNIT)
    # collnet: the switches reduce; each node sends its data up once and receives once
    return (2.0 * (ppn - 1) / ppn if ppn > 1 else 0.0), 1.0 / nics, physics.tree_fill * levels, min(
        nbytes / (2 * nc), chunk)


def _net_channels_GBps(group: Group, channels: int, node_load: float) -> float:
    """What ``channels`` channels move (GB/s of payload) when each carries at most the NIC
    kind's ``nccl_channel_Bps`` and a node's NICs carry ``node_load`` wire bytes per payload
    byte in each direction (infinite where the NIC kind has no such limit)."""
    per_channel = group.cluster.inter_node.nccl_channel_Bps
    if per_channel is None or group.nnodes == 1 or node_load <= 0:
        return math.inf
    return channels * per_channel / 1e9 / node_load


# NCCL's point-to-point schedule (NVIDIA/nccl v2.29.2): a p2p step carries P2P_NVL_CHUNKSIZE
# bytes inside an all-NVLink node, P2P_PCI_CHUNKSIZE inside any other, P2P_NET_CHUNKSIZE once
# the communicator spans nodes (src/init.cc computeBuffSizes); a network channel per 14 GB/s of NIC
# (src/graph/paths.cc, NCCL_P2P_PER_CHANNEL_NET_BW); a channel runs the works of at most
# NCCL_MAX_DEV_WORK_P2P_PER_BATCH peers at once (src/include/device.h)
P2P_CHUNK_NVL = 2.0**19
P2P_CHUNK_NET = 2.0**17
P2P_CHUNK_PCI = 2.0**17
P2P_NET_CHANNEL_GBPS = 14
P2P_PER_BATCH = 8


def _pow2_up(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def p2p_split(group: Group, topo: Topology, peer_bytes: float) -> tuple[int, float]:
    """(channels, chunk bytes) NCCL gives each peer's message of ``peer_bytes`` in an
    all-to-all of ``group`` (NVIDIA/nccl v2.29.2).

    src/graph/paths.cc ncclTopoComputeP2pChannels: ``p2pnChannels`` is the communicator's
    channels rounded up to a power of two; ``p2pnChannelsPerPeer`` is 2 per NVLink of a
    peer inside the node (ncclTopoGetNchannels: on an NVSwitch node, more than the
    communicator has; 2 over PCIe) or, once the communicator spans nodes, one per 14 GB/s
    of the GPU's NIC (at least one per NIC), halved while ``ceil(nranks / 8)`` batches of
    peers would not fit the channels.  src/enqueue.cc scheduleP2pTasksToPlan /
    addP2pToPlan: a peer's message starts on ``nChannelsMin`` channels
    (``p2pnChannelsPerPeer`` halved until every rank fits the channels once), at most one per
    ``minPart`` bytes, and doubles its channels (up to ``p2pnChannelsPerPeer``) while a
    channel's part exceeds ``maxPart``: a chunk / 8 and 32 chunks inside a node, half a chunk
    and one chunk across nodes; on the network a message shorter than 8 chunks moves in half
    chunks, one shorter than a chunk in quarters."""
    n, cross = group.nranks, group.nnodes > 1
    channels = _pow2_up(topo.channels)
    if cross:
        nic_GBps = group.cluster.inter_node.bandwidth_Bps / 1e9
        per_peer = _pow2_up(max(1, math.ceil(nic_GBps / P2P_NET_CHANNEL_GBPS)))
        while per_peer * math.ceil(n / P2P_PER_BATCH) > channels and per_peer > 1:
            per_peer //= 2
        step, min_part, max_part = P2P_CHUNK_NET, P2P_CHUNK_NET / 2, P2P_CHUNK_NET
    else:
        nvlink = topo.intra == "nvlink"
        per_peer = channels if nvlink else min(2, channels)
        step = P2P_CHUNK_NVL if nvlink else P2P_CHUNK_PCI
        min_part, max_part = step / 8, 32 * step
    start = per_peer
    while start * n > channels and start > 1:
        start //= 2
    nc = max(1, min(start, math.ceil(peer_bytes / min_part)))
    part = max(min_part, peer_bytes / nc)
    while part > max_part and nc <= per_peer // 2:
        nc *= 2
        part = peer_bytes / nc
    chunk = step
    if cross:
        chunk = step / 4 if peer_bytes < step else step / 2 if peer_bytes < 8 * step else step
    return nc, chunk


def _p2p(op: str, nbytes: float, group: Group, topo: Topology,
         physics: NcclPhysics) -> CollectiveCost:
    """Point-to-point traffic (NCCL send/recv, all-to-all as grouped send/recv): one Simple
    step; ``sendrecv`` is one message from one rank of ``group`` to another (a pipeline send:
    the group's two ranks), all-to-all every rank sending (n-1)/n of ``nbytes``.

    An all-to-all also pays its pipeline fill: each of its ``n x channels`` parts
    (``p2p_split``) runs concurrently, chunk by chunk, through the peer's FIFO (the
    sender's warps copy a chunk in, the receiver's copy it out: src/device/sendrecv.h), so
    the last chunk of every part costs one chunk more at the part's share of the bandwidth.
    """
    n, nn, ppn, nics = group.nranks, group.nnodes, group.nranks / group.nnodes, group.nics
    cross = nn > 1
    hw = 14.0 if cross else (3.4 if topo.intra == "nvlink" else 5.7)
    lat = physics.latency_scale[topo.arch] * (8.4 + hw) * 1e-6
    if op == "sendrecv":  # one channel per remote peer (paths.cc ncclTopoGetNchannels, 2.10)
        intra, nic = (0.0, 1.0 / nics) if cross else (1.0, 0.0)
        net_channels = 1
    else:
        intra = (ppn - 1) / n
        nic = ppn * (n - ppn) / n / nics if cross else 0.0
        net_channels = topo.channels
    cap = _net_channels_GBps(group, net_channels, nic * nics) * 1e9
    cost = CollectiveCost(op, nbytes, group, "p2p", "Simple", topo.channels, lat, cap,
                          intra, nic, (8.4 + hw) * 1e-6 + nbytes / (
                              1e9 * topo.channels * topo.bw_intra))
    if op == "alltoall":
        peer_bytes = nbytes / n
        nc, chunk = p2p_split(group, topo, peer_bytes)
        piece = min(chunk, peer_bytes / nc)
        fill = piece * n * nc / cost.bandwidth_Bps
        cost = replace(cost, latency_s=lat + fill)
    return cost


def nccl_estimate_s(op: str, nbytes: float, group: Group, algorithm: str,
                    protocol: str) -> float:
    """NCCL's own estimate (s) for one (algorithm, protocol); -1e-6 when unsupported."""
    return estimate_us(_func(op), nbytes, algorithm, protocol, _topology_of(group)) * 1e-6
