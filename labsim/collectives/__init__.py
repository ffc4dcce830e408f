"""Collective communication as values: the algorithms as data and their closed-form costs.

``schedule``: each algorithm (ring, binomial tree, recursive doubling / halving, Rabenseifner,
hierarchical, pipelined chain broadcast, pairwise all-to-all) as the steps of transfers it
makes; ``cost``: the alpha-beta closed forms a lecture derives, and bus bandwidth as
nccl-tests defines it.  ``labsim.sim.collectives`` is the simulated face of the same names.
"""

from labsim.collectives.cost import (
    algbw,
    busbw,
    busbw_factor,
    collective_lower_bound,
    collective_s,
    collective_time,
    collective_time_on,
    crossover_bytes,
    group_link,
    wire_bytes,
)
from labsim.collectives.schedule import ALGORITHMS, OPS, Pattern, Step, normalize, schedule

__all__ = ["ALGORITHMS", "OPS", "Pattern", "Step", "algbw", "busbw",
           "busbw_factor", "collective_lower_bound", "collective_s", "collective_time",
           "collective_time_on", "crossover_bytes", "group_link", "normalize", "schedule",
           "wire_bytes"]
