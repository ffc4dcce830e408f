"""What ``torch.autocast`` does to a model: op dtypes, activation bytes, speed.

- ``autocast_dtypes``: the dtype each common op produces inside autocast, per device;
- ``gpt_activation_bytes``: bytes saved for backward by a ``labsim.lab.GPT`` forward in fp32,
  under autocast, or as a pure bf16 model (``labsim.lab.MemoryMeter``);
- ``matmul_flops_per_s`` and ``training_step_time``: speed by dtype on this device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from labsim.lab.device import time_fn
from labsim.lab.memory import MemoryMeter
from labsim.lab.precision import torch_dtype


def autocast_dtypes(dtype: str = "bf16", device: str = "cpu") -> dict[str, str]:
    """The output dtype of common ops run on fp32 inputs inside ``torch.autocast(dtype)``.

    Matmul-like ops run in the low precision (that is where the speed is); reductions,
    softmax, normalisation and losses run in fp32 (they need the range and the precision).
    The lists are PyTorch's ("Autocast Op Reference" in the AMP docs), per device.
    """
    low = torch_dtype(dtype)
    x = torch.randn(8, 16, device=device)
    w = torch.randn(16, 16, device=device)
    target = torch.randint(0, 16, (8,), device=device)
    ops: dict[str, Callable[[], torch.Tensor]] = {
        "linear": lambda: nn.functional.linear(x, w),
        "matmul": lambda: x @ w,
        "relu": lambda: torch.relu(x),
        "gelu": lambda: nn.functional.gelu(x),
        "softmax": lambda: torch.softmax(x @ w, dim=-1),
        "layer_norm": lambda: nn.functional.layer_norm(x @ w, (16,)),
        "mse_loss": lambda: nn.functional.mse_loss(x @ w, x),
        "cross_entropy": lambda: nn.functional.cross_entropy(x @ w, target),
        "sum": lambda: (x @ w).sum(),
    }
    out = {}
    with torch.autocast(torch.device(device).type, dtype=low):
        for name, op in ops.items():
            out[name] = str(op().dtype).replace("torch.", "")
    return out


def matmul_flops_per_s(
    n: int, dtype: str, device: torch.device | str = "cpu", max_seconds: float = 2.0
) -> float:
    """Achieved FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (2 n^3 FLOP per call)."""
    dt = torch_dtype(dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    timing = time_fn(lambda: a @ b, device=device, warmup=1, repeat=5, max_seconds=max_seconds)
    return 2 * n**3 / timing.min_s


PRECISION_MODES = ("fp32", "autocast-bf16", "autocast-fp16", "pure-bf16")


def gpt_activation_bytes(model: nn.Module, idx: torch.Tensor, mode: str = "fp32") -> int:
    """Bytes autograd saves for backward in one forward of ``model(idx)`` (a ``labsim.lab.GPT``).

    ``mode``: ``"fp32"``; ``"autocast-bf16"`` / ``"autocast-fp16"`` (fp32 weights, the
    forward under ``torch.autocast``); ``"pure-bf16"`` (a bf16 copy of the whole model, as
    when the optimizer keeps no fp32 master weights).
    """
    if mode not in PRECISION_MODES:
        raise ValueError(f"mode={mode!r}; use one of {PRECISION_MODES}")
    if mode == "pure-bf16":
        model = copy.deepcopy(model).to(torch.bfloat16)
    low = torch.float16 if mode == "autocast-fp16" else torch.bfloat16
    with MemoryMeter(model) as meter:
        with torch.autocast(idx.device.type, dtype=low, enabled=mode.startswith("autocast")):
            out = model(idx)
    del out
    return meter.saved_bytes


def training_step_time(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, dtype: str | None,
    *, repeat: int = 5, max_seconds: float = 10.0,
) -> float:
    """Median seconds of forward + backward + AdamW step of a ``labsim.lab.GPT``, in fp32
    (``dtype=None``) or with autocast(``dtype``) (bf16 needs no loss scaler)."""
    device_type = idx.device.type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch_dtype(dtype or "bf16"),
                            enabled=dtype is not None):
            _, loss = model(idx, targets)
        loss.backward()
        opt.step()

    timing = time_fn(step, device=idx.device, warmup=2, repeat=repeat, max_seconds=max_seconds)
    return timing.median_s
