"""Simulation layer (simpy): every simulation owns its own ``simpy.Environment``.

``pipeline``: pipeline schedules executed on stages (p2p messages); ``data_parallel``: gradient
buckets and ZeRO traffic; ``step``: one training step composed of both, with compute, TP
communication, recompute and memory.
"""
