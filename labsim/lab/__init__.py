"""Helpers for the real PyTorch exercises: device choice, synchronised timing, memory meters,
a launcher for multi-process workers, tiny models and synthetic data."""

from labsim.lab.device import Timing, device_name, pick_device, synchronize, time_fn
from labsim.lab.gpt import GPT, random_batch
from labsim.lab.launcher import LaunchResult, LaunchTimeout, WorkerError, free_port, launch
from labsim.lab.memory import (
    MemoryMeter,
    grad_bytes,
    optimizer_state_bytes,
    param_bytes,
    saved_activation_bytes,
    tensor_bytes,
)

__all__ = [
    "GPT",
    "LaunchResult",
    "LaunchTimeout",
    "MemoryMeter",
    "Timing",
    "WorkerError",
    "device_name",
    "free_port",
    "grad_bytes",
    "launch",
    "optimizer_state_bytes",
    "param_bytes",
    "pick_device",
    "random_batch",
    "saved_activation_bytes",
    "synchronize",
    "tensor_bytes",
    "time_fn",
]
