"""Simulation layer (simpy): every simulation owns its own ``simpy.Environment``.

``step``: one training step (pipeline schedule, TP/DP/ZeRO communication, recompute, memory).
"""
