"""The simulation layer (simpy).

Every simulation owns its own ``simpy.Environment``; nothing here keeps module-level state.
"""

from labsim.sim.launch import LaunchRun, simulate_chain

__all__ = ["LaunchRun", "simulate_chain"]
