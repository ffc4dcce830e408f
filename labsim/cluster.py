"""A cluster of GPUs: nodes x GPUs per node, a switch inside each node, NICs between nodes.

The network model (values only; the simpy engine in ``labsim.sim.network`` executes it):

* every GPU has one full-duplex port into its node's switch (NVSwitch, or a PCIe switch) with
  the ``intra_node`` link's bandwidth per direction.  A transfer between two GPUs of one node
  uses the sender's port in its *tx* direction and the receiver's port in its *rx* direction;
  the switch itself is non-blocking (true of NVSwitch; an idealisation for PCIe trees);
* every node has ``nics_per_node`` NICs (full duplex, ``inter_node`` bandwidth per direction)
  into a non-blocking fabric (a full fat tree).  Local GPU ``i`` uses NIC
  ``i * nics_per_node // gpus_per_node`` (GPU-NIC affinity as on a DGX: one NIC per GPU);
  a transfer between nodes uses the sender's NIC (tx) and the receiver's NIC (rx).  The hop
  from GPU to NIC through PCIe is not modelled separately (GPUDirect RDMA).

So each transfer crosses exactly two *pipes* (one link direction each).  Pipes are shared:
flows on one pipe split its bandwidth max-min fairly (two flows on one direction each get
half), and opposite directions are independent (full duplex).  ``labsim.network`` computes that
allocation; the simulator and the closed forms both use it.

``in_network_reduction`` says the fabric reduces in the switches (InfiniBand SHARP, NCCL's
CollNet with ``NCCL_COLLNET_ENABLE=1``); NVLink SHARP (NVLS) inside a node needs no flag: NCCL
uses it on NVSwitch systems of Hopper and later.

``nccl_net_channels`` is the channel count NCCL gave communicators that span nodes, where it was
seen on the system itself (``NCCL_DEBUG=INFO`` prints "N coll channels") and labsim's search,
which does not know the system's PCIe tree, would choose otherwise; None lets the search decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labsim.hardware import GPU, Link, gpu, link

MAX_GPUS = 2**20  # no cluster this large exists (the largest are ~10^5 GPUs)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs of one kind, a switch per node, NICs between nodes.

    Ranks are numbered node-major: rank ``r`` is local GPU ``r % gpus_per_node`` of node
    ``r // gpus_per_node`` (as ``torchrun`` numbers them).
    """

    gpu: GPU
    nodes: int
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    nics_per_node: int | None = None  # default: one NIC per GPU
    name: str = field(default="", compare=False)
    in_network_reduction: bool = False
    nccl_net_channels: int | None = None  # as NCCL_DEBUG=INFO showed it; None: labsim's search

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu", gpu(self.gpu))
        object.__setattr__(self, "intra_node", link(self.intra_node))
        object.__setattr__(self, "inter_node", link(self.inter_node))
        for attr in ("nodes", "gpus_per_node"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Cluster: {attr} must be a whole number >= 1, got {value!r}")
            object.__setattr__(self, attr, int(value))
        if self.nodes * self.gpus_per_node > MAX_GPUS:
            raise ValueError(f"Cluster: {self.nodes} x {self.gpus_per_node} GPUs is more than the "
                             f"{MAX_GPUS:,} this simulator accepts; use fewer nodes")
        if not isinstance(self.in_network_reduction, bool):
            raise ValueError(f"Cluster: in_network_reduction must be True or False, got "
                             f"{self.in_network_reduction!r}")
        nics = self.gpus_per_node if self.nics_per_node is None else self.nics_per_node
        if isinstance(nics, bool) or not isinstance(nics, (int, np.integer)) or \
                not 1 <= nics <= self.gpus_per_node:
            raise ValueError(
                f"Cluster: nics_per_node must be between 1 and gpus_per_node="
                f"{self.gpus_per_node}, got {nics!r}"
            )
        if self.gpus_per_node % nics:
            raise ValueError(
                f"Cluster: nics_per_node={nics} must divide gpus_per_node="
                f"{self.gpus_per_node} (each NIC serves the same number of GPUs)"
            )
        object.__setattr__(self, "nics_per_node", int(nics))
        ch = self.nccl_net_channels
        if ch is not None:
            if isinstance(ch, bool) or not isinstance(ch, (int, np.integer)) or not 1 <= ch <= 64:
                raise ValueError(f"Cluster: nccl_net_channels must be a whole number from 1 to "
                                 f"64 (NCCL's MAXCHANNELS), or None to let the search decide; "
                                 f"got {ch!r}")
            object.__setattr__(self, "nccl_net_channels", int(ch))
        if not self.name:
            object.__setattr__(
                self, "name", f"{self.nodes}x{self.gpus_per_node} {self.gpu.name}"
            )

    def __repr__(self) -> str:
        return (
            f"Cluster({self.name!r}: {self.nodes} node(s) x {self.gpus_per_node} "
            f"{self.gpu.name}, intra={self.intra_node.name}, inter={self.nics_per_node} x "
            f"{self.inter_node.name}"
            + (f", {self.nccl_net_channels} NCCL channels across nodes"
               if self.nccl_net_channels is not None else "") + ")"
        )

    # -- ranks --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of GPUs (ranks) in the cluster."""
        return self.nodes * self.gpus_per_node

    n_gpus = world_size

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} out of range: this cluster has ranks 0..{self.world_size - 1}"
            )
        return int(rank)

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank``."""
        return self._check_rank(rank) // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index inside its node."""
        return self._check_rank(rank) % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        """The global rank of local GPU ``local`` on ``node``."""
        if not (0 <= node < self.nodes and 0 <= local < self.gpus_per_node):
            raise ValueError(f"no GPU {local} on node {node} in {self!r}")
        return node * self.gpus_per_node + local

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def nic_of(self, rank: int) -> int:
        """Index (within its node) of the NIC that ``rank`` uses for inter-node traffic."""
        return self.local_rank(rank) * self.nics_per_node // self.gpus_per_node

    def link_between(self, a: int, b: int) -> Link:
        """The link type a transfer from ``a`` to ``b`` is limited by."""
        return self.intra_node if self.same_node(a, b) else self.inter_node

    @property
    def nic_Bps_per_gpu(self) -> float:
        """Inter-node line rate per GPU when every GPU of a node sends at once."""
        return self.inter_node.bandwidth_Bps * self.nics_per_node / self.gpus_per_node

    @property
    def gpu_nic_Bps(self) -> float:
        """The GPU-to-NIC PCIe path as NCCL's topology rates it: one x16 link of the GPU's
        generation (PCIe 4.0 on A100 systems, 5.0 on H100: DGX A100 / DGX H100 architecture
        white papers), width x speed / 80 GB/s = 24 or 48 GB/s (``src/graph/topo.cc``)."""
        cc = self.gpu.compute_capability or 8.0
        return (48e9 if cc >= 9 else 24e9 if cc >= 8 else 12e9)

    # -- pipes (one link direction each) ------------------------------------------------
    @property
    def n_pipes(self) -> int:
        return 2 * self.world_size + 2 * self.nodes * self.nics_per_node

    def pipe_capacities(self, achieved: bool = True) -> np.ndarray:
        """Bandwidth of every pipe in bytes/s: GPU tx, GPU rx, NIC tx, NIC rx.

        ``achieved=True`` uses what NCCL reaches (``Link.achieved_Bps``), ``False`` the line
        rate.
        """
        n, m = self.world_size, self.nodes * self.nics_per_node
        intra = self.intra_node.achieved_Bps if achieved else self.intra_node.bandwidth_Bps
        inter = self.inter_node.achieved_Bps if achieved else self.inter_node.bandwidth_Bps
        return np.concatenate([np.full(2 * n, intra), np.full(2 * m, inter)])

    def pipe_names(self) -> list[str]:
        names = [f"gpu{r} tx" for r in range(self.world_size)]
        names += [f"gpu{r} rx" for r in range(self.world_size)]
        nics = [(node, k) for node in range(self.nodes) for k in range(self.nics_per_node)]
        names += [f"node{node} nic{k} tx" for node, k in nics]
        names += [f"node{node} nic{k} rx" for node, k in nics]
        return names

    def nic_pipe(self, node: int, nic: int, rx: bool = False) -> int:
        """Index of NIC ``nic`` of ``node``'s tx (or rx) pipe."""
        n, m = self.world_size, self.nodes * self.nics_per_node
        return 2 * n + (m if rx else 0) + node * self.nics_per_node + nic

    def paths(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The two pipes (tx, rx) each transfer ``src[i] -> dst[i]`` crosses; shape (m, 2)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        n, g = self.world_size, self.gpus_per_node
        nics = self.nodes * self.nics_per_node
        same = (src // g) == (dst // g)
        nic_src = (src // g) * self.nics_per_node + (src % g) * self.nics_per_node // g
        nic_dst = (dst // g) * self.nics_per_node + (dst % g) * self.nics_per_node // g
        tx = np.where(same, src, 2 * n + nic_src)
        rx = np.where(same, n + dst, 2 * n + nics + nic_dst)
        return np.stack([tx, rx], axis=1)

    def latencies(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Alpha (s) of each transfer: the intra- or inter-node link's latency."""
        same = (np.asarray(src) // self.gpus_per_node) == (np.asarray(dst) // self.gpus_per_node)
        return np.where(same, self.intra_node.latency_s, self.inter_node.latency_s)


# -- presets --------------------------------------------------------------------------------
def dgx_a100(nodes: int = 1) -> Cluster:
    """NVIDIA DGX A100: 8 x A100-80GB on NVSwitch (NVLink3), 8 x HDR 200 Gb/s NICs per node
    (NVIDIA DGX A100 system architecture white paper)."""
    return Cluster("A100-80GB", nodes, 8, "nvlink3", "ib-hdr", 8, name=f"DGX A100 x{nodes}")


def dgx_h100(nodes: int = 1) -> Cluster:
    """NVIDIA DGX H100: 8 x H100-SXM on NVSwitch (NVLink4), 8 x NDR 400 Gb/s NICs per node
    (NVIDIA DGX H100 user guide)."""
    return Cluster("H100-SXM", nodes, 8, "nvlink4", "ib-ndr", 8, name=f"DGX H100 x{nodes}")


def pcie_box(nodes: int = 1, gpus_per_node: int = 8, gpu_name: str = "A100-80GB",
             pcie: str = "pcie4-x16", nic: str = "ib-hdr", nics_per_node: int = 1) -> Cluster:
    """A server of PCIe GPUs without NVLink: GPU-GPU traffic goes over PCIe (one x16 slot per
    GPU, the switch idealised as non-blocking) and one NIC per node by default."""
    return Cluster(gpu_name, nodes, gpus_per_node, pcie, nic, nics_per_node,
                   name=f"{gpus_per_node}x{gpu_name} {pcie} x{nodes}")


PRESETS = {"dgx-a100": dgx_a100, "dgx-h100": dgx_h100, "pcie-a100": pcie_box}


def cluster(name: str, nodes: int = 1) -> Cluster:
    """A preset by name (``dgx-a100``, ``dgx-h100``, ``pcie-a100``) with ``nodes`` nodes."""
    if not isinstance(name, str):
        raise ValueError(f"cluster name must be a string among {', '.join(PRESETS)}, got "
                         f"{name!r}")
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key](nodes=nodes)
