"""NCCL's own cost model ("tuner"), ported from NCCL 2.30.7 (``src/graph/tuning.cc``,
``src/enqueue.cc``, ``src/graph/search.cc``): how NCCL estimates a collective's time and which
algorithm and protocol it picks.

For every (algorithm, protocol) NCCL keeps a latency (``baseLat`` + ``hwLat`` per hop, by link
class) and a bandwidth (channels x per-channel graph bandwidth, with protocol factors and
per-channel caps); its estimate of a call of ``nbytes`` is ``lat + nbytes / bw``, and it runs
the (algorithm, protocol) of least estimate, ties to the lower index (Tree before Ring, LL
before LL128 before Simple).  ``NCCL_ALGO`` / ``NCCL_PROTO`` only zero bandwidths: an excluded
pair is never chosen.  ``Topology`` is what this model sees of a communicator; the search for
it (channels and bandwidth per channel) is in ``labsim.collectives.nccl``.

Only the selection is NCCL's guess: the time a collective really takes is the physical model
of ``labsim.collectives.nccl``, which starts from these tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOS = ("LL", "LL128", "Simple")
FUNCS = ("broadcast", "reduce", "allgather", "reduce_scatter", "allreduce")
_ARCH = {"volta": 0, "ampere": 1, "hopper": 2, "blackwell": 3}

# tuning.cc ncclTunerConstantsDefaults (microseconds; GB/s)
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "collnet_direct": (0, 0, 0),
            "collnet_chain": (0, 0, 0), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0),
            "pat": (8.0, 8.0, 8.0)}
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25),
               "pat": (0, 0, 4.0)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
             "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0),
             "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31),
            "collnet_chain": (0, 0, 30), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 20.9),
            "pat": (0, 0, 14)},
}
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
RING_LL128_BW = ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (40.0,) * 3)
TREE_LL128_BW = ((20.0,) * 3, (20.0,) * 3, (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
NVLS_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)
# treeCorrectionFactor[proto][log2(nbytes / 64)], 64 B .. 256 MiB
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9, .9),
}
# threads and per-thread work before a call uses more channels (comm.h, device.h)
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
NET_OVERHEAD_US = 1.0  # getNetOverhead on Intel x86 (AMD x86: 2.0)


@dataclass(frozen=True)
class Topology:
    """What NCCL's tuner knows of a communicator: ranks, nodes, the GPUs' architecture, the
    intra-node link class, and the search graphs (channels x GB/s per channel).

    ``channels`` is the execution channel count (``comm->nChannels``: twice the search
    channels, ``connect.cc``); ``nvls_heads``/``nvls_bw``/``nvls_bw_inter`` the NVLS graph
    (0 heads: no NVLS; NVLS and NVLS-Tree read it, not the ring's graph: ``graphs[]`` of
    ``ncclTopoTuneModel``);
    ``collnet`` whether in-network reduction (SHARP, ``NCCL_COLLNET_ENABLE=1``) is available;
    ``ll128_net`` whether LL128 may cross the network (the NIC sits on the GPU's PCIe switch).
    """

    nranks: int
    nnodes: int
    arch: str
    intra: str  # "nvlink" or "pcie"
    ring_channels: int
    bw_intra: float  # GB/s per search channel
    bw_inter: float
    channels: int
    nvls_heads: int = 0
    nvls_bw: float = 0.0
    nvls_bw_inter: float = 0.0
    nvls_channels: int = 16
    nvswitch: bool = False
    collnet: bool = False
    ll128_net: bool = True

    @property
    def ppn(self) -> float:
        return self.nranks / self.nnodes

    @property
    def arch_index(self) -> int:
        return _ARCH[self.arch]

    @property
    def node_index(self) -> int:
        """Column of the per-arch tables: 1 node, 2 nodes, more (``index2``)."""
        return 0 if self.nnodes == 1 else 1 if self.nnodes == 2 else 2


def log2i(x: float) -> int:
    """NCCL's ``log2i``: floor(log2(x)) for x >= 1, else 0."""
    return int(math.floor(math.log2(x))) if x >= 1 else 0


def _nsteps(func: str, n: int) -> int:
    return 2 * (n - 1) if func == "allreduce" else n - 1 if func in (
        "allgather", "reduce_scatter") else n


def supported(func: str, algo: str, proto: str, topo: Topology) -> bool:
    """Whether NCCL models (func, algo, proto) on ``topo`` at all (tuning.cc:294-304, 498-541)."""
    if func in ("broadcast", "reduce") and algo != "ring":
        return False
    if func in ("allgather", "reduce_scatter") and algo not in (
            "ring", "pat", "nvls", "collnet_direct"):
        return False
    if func == "allreduce" and algo == "pat":
        return False
    if algo in ("nvls", "nvls_tree", "pat", "collnet_direct", "collnet_chain") and \
            proto != "Simple":
        return False
    if algo == "pat" and not (topo.nnodes == topo.nranks and topo.nranks > 1):
        return False  # PAT: one GPU per node only (NCCL_PAT_ENABLE auto)
    if algo in ("nvls", "nvls_tree") and topo.nvls_heads < 2:
        return False
    if algo == "nvls_tree" and topo.nnodes == 1:
        return False
    if algo == "nvls" and topo.nnodes > 1 and not topo.collnet:
        return False
    if algo == "nvls" and func != "allreduce" and topo.nnodes > 1:
        return False
    if algo.startswith("collnet") and (not topo.collnet or topo.nnodes < 2):
        return False
    if algo == "collnet_direct" and (not topo.nvswitch or func != "allreduce"):
        return False
    if proto == "LL128" and topo.nnodes > 1 and not topo.ll128_net:
        return False
    return True


def latency_bandwidth(func: str, algo: str, proto: str, topo: Topology,
                      ll_cap: bool = True) -> tuple[float, float]:
    """NCCL's (latency in us, algorithm bandwidth in GB/s) of (func, algo, proto) on ``topo``:
    ``comm->latencies`` and ``comm->bandwidths`` of ncclTopoTuneModel; bandwidth 0 when the
    pair is not supported.  ``ll_cap=False`` leaves out LL's ceiling on the whole bandwidth
    (``llMaxBws``), the one cap that does not grow with the channels: what the channels
    themselves carry."""
    if not supported(func, algo, proto, topo):
        return 0.0, 0.0
    return (_latency(func, algo, PROTOS.index(proto), topo, _nsteps(func, topo.nranks)),
            bandwidth_GBps(func, algo, proto, topo, topo.ring_channels, topo.bw_intra,
                           topo.bw_inter, ll_cap))


def bandwidth_GBps(func: str, algo: str, proto: str, topo: Topology, channels: int,
                   intra_GBps: float, inter_GBps: float, ll_cap: bool = True) -> float:
    """``latency_bandwidth``'s bandwidth of a supported pair, its search graph read as
    ``channels`` channels of ``intra_GBps`` inside a node and ``inter_GBps`` across nodes
    (NVLS and NVLS-Tree read the NVLS graph of ``topo`` instead): with the communicator's
    graph, NCCL's table; with a call's own channels at a channel's rate, what those carry."""
    a, k = topo.arch_index, topo.node_index
    n, nn, ppn = topo.nranks, topo.nnodes, topo.ppn
    nsteps = _nsteps(func, n)
    collnet = algo.startswith("collnet")
    if algo in ("nvls", "nvls_tree"):
        nch = topo.nvls_heads
        intra_bw = topo.nvls_bw * NVLS_EFFICIENCY[a] * (nch - 1) / nch
        intra_bw *= 2.0 if func == "allreduce" else (ppn - 1) / ppn
        inter_bw = topo.nvls_bw_inter * (2 if nn <= 2 and algo == "nvls_tree" else 1)
        caps = [intra_bw] + ([inter_bw] if nn > 1 else [])
        if algo == "nvls_tree":
            caps.append(NVLS_TREE_BW[a][k])
        bus = nch * min(caps)
    else:
        nch = channels
        bus = nch * (intra_GBps if nn <= 2 or collnet else inter_GBps)
    ll_max = LL_MAX_BW[a][k] if ll_cap else math.inf
    if algo == "ring" and proto == "LL":
        bus = min(ll_max, bus * .5)
    if algo == "ring" and proto == "LL128":
        bus = min(bus * 0.92, nch * RING_LL128_BW[a][k])
    if algo == "tree" and func == "allreduce":
        bus = min(bus * .92, nch * TREE_BW[a][k])
    if algo == "tree" and proto == "LL":
        bus = min(bus / 3.8, ll_max)
    if algo == "tree" and proto == "LL128":
        bus = min(bus * (7.0 / 9.0 if nn == 1 else 120.0 / 128.0), nch * TREE_LL128_BW[a][k])
    if algo == "pat":
        bus *= .75
    if algo == "collnet_direct":
        factor = ppn / nch
        bus /= factor - (factor - 1) / 2
        if a >= 2:
            bus *= .85
    if algo in ("ring", "nvls", "nvls_tree"):
        bus *= n / nsteps
    elif not (func in ("allgather", "reduce_scatter") and algo != "ring"):
        bus *= .5
    return bus


def _latency(func: str, algo: str, p: int, topo: Topology, nsteps: int) -> float:
    n, nn, ppn = topo.nranks, topo.nnodes, topo.ppn
    lat = BASE_LAT[algo][p]
    intra = HW_LAT[topo.intra][algo][p]
    inter = HW_LAT["net"]["tree" if ppn == 1 else algo][p]  # net plugin latency: 0
    if algo == "ring":
        if func in ("broadcast", "reduce"):
            hw = HW_LAT[topo.intra if nn == 1 else "net"]
            return lat + nsteps * hw["tree" if p == 2 else "ring"][p]
        overhead = NET_OVERHEAD_US * (3 if p == 2 else 1) if nn > 1 else 0.0
        intra = max(intra, overhead)
        inter_steps = 0 if nn == 1 else 2 * (nn - 1) if func == "allreduce" else nn - 1
        return lat + (nsteps - inter_steps) * intra + inter_steps * inter
    if algo == "tree":
        return lat + 2 * ((ppn - 1) * intra + log2i(nn) * inter)
    if algo == "collnet_direct":
        return lat + 2 * (min(1, ppn - 1) * intra + (ppn - 1) * 0.4) + inter
    if algo == "collnet_chain":
        return lat + 2 * (ppn - 1) * intra + inter
    if algo == "nvls":
        return intra + (inter if nn > 1 else 0.0)
    if algo == "nvls_tree":
        return lat + intra + 2 * log2i(nn) * inter
    return lat + log2i(nn) * (inter / 3.5) + n * 2.8  # pat


def estimate_us(func: str, nbytes: float, algo: str, proto: str, topo: Topology) -> float:
    """``ncclTopoGetAlgoTime``: NCCL's estimate in us of one call (-1 when unsupported),
    with the tree correction by size and the ring "plateau" latency factor."""
    lat, bw = latency_bandwidth(func, algo, proto, topo)
    if bw == 0:
        return -1.0
    return _estimate(func, nbytes, algo, proto, topo, lat, bw, log2i(int(nbytes) >> 6))


def _estimate(func: str, nbytes: float, algo: str, proto: str, topo: Topology, lat: float,
              bw: float, log_size: int) -> float:
    """``estimate_us`` of a supported pair from its ``latency_bandwidth`` (``log_size``: log2i
    of the size in 64-byte units, the tree correction's index)."""
    if algo == "tree" and func == "allreduce" and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[proto][log_size]
    if (algo == "ring" and proto == "Simple" and topo.nnodes > 1 and func == "allreduce"
            and nbytes / (topo.channels * topo.nranks) >= 64):
        lat *= 1.9 if topo.arch == "volta" else 1.4
    return lat + nbytes / (1000 * bw)


def parse_choice(value: str, names: tuple[str, ...], what: str) -> frozenset[str]:
    """The set ``value`` enables, in NCCL_ALGO / NCCL_PROTO syntax: ``"auto"`` (all), a name,
    a comma-separated list, or ``"^a,b"`` (all but those); names are case-insensitive."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be 'auto' or names among {', '.join(names)}, got "
                         f"{value!r}")
    text = value.strip()
    if text.lower() == "auto":
        return frozenset(names)
    exclude = text.startswith("^")
    lookup = {n.lower(): n for n in names}
    chosen = set()
    for part in text.lstrip("^").split(","):
        key = part.strip().lower()
        if key not in lookup:
            textbook = key in ("hierarchical", "recursive_doubling", "rabenseifner",
                               "recursive_halving", "pairwise", "halving_doubling",
                               "binomial")
            hint = (f"; {part.strip()!r} is a textbook algorithm: pass protocol='alpha-beta'"
                    if textbook else "")
            raise ValueError(f"{what}={value!r}: unknown {part.strip()!r}; choose among "
                             f"{', '.join(names)} (NCCL_{what.upper()} syntax: a list, or "
                             f"'^' to exclude){hint}")
        chosen.add(lookup[key])
    return frozenset(names) - chosen if exclude else frozenset(chosen)


@lru_cache(maxsize=4096)
def supported_pairs(func: str, topo: Topology) -> tuple[tuple[str, str, float, float], ...]:
    """(algorithm, protocol, latency, bandwidth) of every pair ``latency_bandwidth`` gives a
    bandwidth for ``func`` on ``topo``, in NCCL's order (algorithm, then protocol): what
    ``select`` compares, the same for every size (NCCL computes its tables once per
    communicator, ``ncclTopoTuneModel``)."""
    pairs = ((a, p, *latency_bandwidth(func, a, p, topo)) for a in ALGOS for p in PROTOS)
    return tuple(pair for pair in pairs if pair[3])


def select(func: str, nbytes: float, topo: Topology, algorithms: frozenset[str] = frozenset(
        ALGOS), protocols: frozenset[str] = frozenset(PROTOS)) -> tuple[str, str, float]:
    """NCCL's pick for one call: the (algorithm, protocol, estimate in us) of least estimate
    among the enabled ones, ties to the lower index (``topoGetAlgoInfo``)."""
    best: tuple[str, str, float] | None = None
    log_size = log2i(int(nbytes) >> 6)
    for algo, proto, lat, bw in supported_pairs(func, topo):
        if algo not in algorithms or proto not in protocols:
            continue
        t = _estimate(func, nbytes, algo, proto, topo, lat, bw, log_size)
        if best is None or t < best[2]:
            best = (algo, proto, t)
    if best is None:
        raise ValueError(
            f"no algorithm/protocol available for {func} on {topo.nranks} ranks among "
            f"{sorted(algorithms)} x {sorted(protocols)} (NCCL would fail the same way); "
            "allow more algorithms or protocols")
    return best


def channels_threads(algo: str, proto: str, nbytes: float, topo: Topology) -> tuple[int, int]:
    """Channels and threads NCCL gives one call (``topoGetAlgoInfo``): Ring and Tree drop a
    channel, then halve threads, while each thread would have less than its threshold."""
    if algo in ("nvls", "nvls_tree"):
        return topo.nvls_channels, 640
    nc, nt = topo.channels, MAX_THREADS[proto]
    threshold = THREAD_THRESHOLD[proto] * (topo.nranks if algo == "ring" and proto == "LL"
                                           else 1)
    while nbytes < nc * nt * threshold and nc >= 2:
        nc -= 1
    while nbytes < nc * nt * threshold and nt % 128 == 0:
        nt //= 2
    return nc, nt
