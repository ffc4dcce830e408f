"""The simulation layer (simpy): the network with shared links, collectives as processes.

Every simulation owns its own ``simpy.Environment``; nothing here keeps module-level state.
"""

from labsim.sim.collectives import (
    CollectiveResult,
    run_collective,
    simulate_collective,
    start_collective,
)
from labsim.sim.network import Network

__all__ = ["CollectiveResult", "Network", "run_collective", "simulate_collective",
           "start_collective"]
