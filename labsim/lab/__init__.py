"""Helpers for the real PyTorch exercises: device choice, synchronised timing, memory meters,
a launcher for multi-process workers, tiny models and synthetic data."""

from labsim.lab.device import Timing, device_name, pick_device, synchronize, time_fn

__all__ = ["Timing", "device_name", "pick_device", "synchronize", "time_fn"]
