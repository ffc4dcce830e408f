"""The simulation layer (simpy).

Every simulation owns its own ``simpy.Environment``; nothing here keeps module-level state.
"""

from labsim.sim.decode import DecodeResult, simulate_decode_step

__all__ = ["DecodeResult", "simulate_decode_step"]
