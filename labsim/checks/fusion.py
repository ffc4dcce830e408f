"""Checks for the kernel-fusion lab: a hand-fused element-wise chain and the launch model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labsim.checks._core import Case, close, raises, run_check
from labsim.experiments.fusion import bias_gelu_dropout_residual, chain_inputs
from labsim.fusion import fit_launch_model
from labsim.lab.profile import torch_calls


def _fused_compare(numel: int | None) -> Callable[[Any, Any], str | None]:
    base = close(1e-6, 1e-6)

    def compare(got: Any, expected: Any) -> str | None:
        out, full_size = got
        reason = base(out, expected)
        if reason:
            return reason
        if numel is not None and full_size > 1:
            return (
                f"{full_size} full-size tensors were created; a fused chain creates only its "
                "output: work on row blocks and reuse one block-sized buffer"
            )
        return None

    return compare


def fused_chain(fn: Callable[..., torch.Tensor]) -> None:
    """``fn(x, bias, residual, keep, p, chunk_rows=256)`` equals the separate ops, and builds
    no full-size intermediate (only its output)."""
    specs = [
        ("16 rows in blocks of 4", 16, 8, 0.1, 4, torch.float32, False),
        ("37 rows, blocks of 8 (last block short)", 37, 16, 0.25, 8, torch.float32, False),
        ("blocks larger than the tensor", 3, 5, 0.5, 64, torch.float32, False),
        ("p = 0 (dropout keeps everything)", 9, 4, 0.0, 2, torch.float32, False),
        ("float64", 12, 6, 0.3, 5, torch.float64, False),
        ("one row", 1, 32, 0.1, 1, torch.float32, False),
        ("256 x 64 in blocks of 32: only the output is full-size", 256, 64, 0.1, 32,
         torch.float32, True),
    ]
    cases = []
    for seed, (name, rows, hidden, p, chunk, dtype, watch) in enumerate(specs):
        inp = chain_inputs(rows, hidden, p=p, seed=seed, dtype=dtype)
        expected = bias_gelu_dropout_residual(*inp.args)
        cases.append(Case(name, inp.args, {"chunk_rows": chunk}, expected,
                          _fused_compare(inp.numel if watch else None)))

    def measured(*args: Any, **kwargs: Any) -> tuple[Any, int]:
        calls = torch_calls(fn, *args, **kwargs)
        full = args[0].numel()
        return calls.result, sum(1 for n in calls.numels if n >= full)

    run_check("fused_chain", measured, cases)


def launch_model(fn: Callable[..., tuple[float, float]]) -> None:
    """``fn(nbytes, times_s) -> (launch_s, bandwidth_Bps)``: least-squares line fit."""
    def line(launch_s: float, bw: float, sizes: list[float]) -> list[float]:
        return [launch_s + s / bw for s in sizes]

    sizes = [1e3, 1e5, 1e6, 1e7, 1e8]
    exact = [(5e-6, 10e9), (20e-6, 2e12), (0.0, 1e9), (1e-3, 50e9)]
    cases = [
        Case(f"exact line: launch {ls * 1e6:g} us, {bw / 1e9:g} GB/s", (sizes, line(ls, bw, sizes)),
             {}, (ls, bw))
        for ls, bw in exact
    ]
    noisy_t = [t * f for t, f in zip(line(5e-6, 10e9, sizes), (1.02, 0.97, 1.01, 1.0, 1.0))]
    cases.append(Case("slightly noisy measurements (least squares)", (sizes, noisy_t), {},
                      fit_launch_model(sizes, noisy_t)))
    cases.append(Case("two points", ([0.0, 4e6], [3e-6, 3e-6 + 4e6 / 8e9]), {}, (3e-6, 8e9)))
    cases.append(Case("one size only: cannot separate the terms -> ValueError",
                      ([1e6, 1e6], [1e-4, 1.1e-4]), {}, None, raises(ValueError)))
    run_check("launch_model", fn, cases, compare=close(1e-6, 1e-12))
