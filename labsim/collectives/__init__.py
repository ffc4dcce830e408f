"""Collective communication as values: NCCL's model, the textbook algorithms, closed forms.

``tuner``: NCCL's own cost model and choice (2.30.7 port); ``group``: a communicator on a
cluster and NCCL's channel search; ``nccl``: what NCCL's choice physically costs (latency,
bandwidth, the loads it puts on links); ``schedule``: the textbook algorithms (ring, binomial
tree, recursive doubling / halving, Rabenseifner, hierarchical, pipelined chain, pairwise) as
steps of transfers; ``cost``: their alpha-beta closed forms; ``bandwidth``: nccl-tests'
algbw and busbw;
``estimate``: the closed-form face on a cluster (``estimate_collective``).
``labsim.sim.collectives`` is the simulated face of the same names.
"""

from labsim.collectives.bandwidth import algbw, busbw, busbw_factor
from labsim.collectives.cost import collective_lower_bound, collective_time, crossover_bytes
from labsim.collectives.estimate import CollectiveResult, estimate_collective
from labsim.collectives.group import Group, group_of, strided_group
from labsim.collectives.nccl import CollectiveCost, plan_collective
from labsim.collectives.schedule import ALGORITHMS, OPS, Pattern, Step, normalize, schedule
from labsim.collectives.tuner import ALGOS as NCCL_ALGORITHMS
from labsim.collectives.tuner import PROTOS as NCCL_PROTOCOLS

__all__ = ["ALGORITHMS", "NCCL_ALGORITHMS", "NCCL_PROTOCOLS", "OPS", "CollectiveCost",
           "CollectiveResult", "Group", "Pattern", "Step", "algbw", "busbw", "busbw_factor",
           "collective_lower_bound", "collective_time", "crossover_bytes",
           "estimate_collective", "group_of", "normalize", "plan_collective", "schedule",
           "strided_group"]
