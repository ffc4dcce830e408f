"""The simulation layer (simpy): every simulation owns its own ``simpy.Environment``.

``network``: flows over shared links (weighted max-min); ``collectives``: collectives as flows
(NCCL model) or as textbook steps;
``pipeline``: pipeline schedules executed on stages (p2p messages); ``data_parallel``: gradient
buckets and ZeRO traffic; ``step``: one training step composed of them, with compute, TP
communication, recompute and memory; ``decode``: an inference decode step, HBM streaming
layers while the SMs compute; ``launch``: kernel launches from a host to a device. Nothing here
keeps module-level state.
"""

from labsim.sim.collectives import simulate_collective, start_collective
from labsim.sim.fusion import LaunchRun, simulate_chain
from labsim.sim.loading import LoaderResult, simulate_dataloader
from labsim.sim.network import Network
from labsim.sim.quantization import DecodeResult, simulate_decode_step

__all__ = sorted(name for name in dir() if not name.startswith("_")
                 and callable(globals()[name]))
