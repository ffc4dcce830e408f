"""Simulation layer (simpy): every simulation owns its own ``simpy.Environment``."""
