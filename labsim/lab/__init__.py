"""Infrastructure for the real PyTorch exercises: device and dtype choice, synchronised timing
(``device``; ``timing`` for comparisons that survive a busy machine), memory meters
(``memory``), a launcher for multi-process workers (``launcher`` and its child process
``worker``), an op recorder (``profile``), the small models the labs train (``models``) and
synthetic data (``datasets``).

Nothing here is an exercise's solution: references live beside their checks in
``labsim.checks``, measurements a lab shows in ``labsim.experiments``.
"""

from labsim.lab.datasets import random_batch
from labsim.lab.device import (
    AsyncQueue,
    Timing,
    cpu_bf16_units,
    cpu_cache_bytes,
    device_name,
    pick_device,
    synchronize,
    time_fn,
    time_queued,
    torch_dtype,
)
from labsim.lab.launcher import LaunchResult, LaunchTimeout, WorkerError, free_port, launch
from labsim.lab.memory import (
    LiveBytes,
    MemoryMeter,
    grad_bytes,
    optimizer_state_bytes,
    param_bytes,
    saved_activation_bytes,
    tensor_bytes,
)
from labsim.lab.models import GPT
from labsim.lab.timing import Comparison, compare, one_thread, time_interleaved

__all__ = [
    "AsyncQueue",
    "Comparison",
    "GPT",
    "LaunchResult",
    "LaunchTimeout",
    "LiveBytes",
    "MemoryMeter",
    "Timing",
    "WorkerError",
    "compare",
    "cpu_bf16_units",
    "cpu_cache_bytes",
    "device_name",
    "free_port",
    "grad_bytes",
    "launch",
    "one_thread",
    "optimizer_state_bytes",
    "param_bytes",
    "pick_device",
    "random_batch",
    "saved_activation_bytes",
    "synchronize",
    "tensor_bytes",
    "time_interleaved",
    "time_fn",
    "time_queued",
    "torch_dtype",
]
