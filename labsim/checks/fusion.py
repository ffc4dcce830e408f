"""Checks for the kernel-fusion lab: a hand-fused element-wise chain and the launch model.

The fused chain must equal the separate operators (``bias_gelu_dropout_residual``, which it
must not call) and create no full-size tensor but its output: the recorder counts, at the
dispatcher, every tensor an operator creates (views and in-place results are not new).
"""

from __future__ import annotations

import torch

from labsim.checks._core import Case, Outcome, Spec, close, raises
from labsim.experiments.fusion import bias_gelu_dropout_residual, chain_inputs
from labsim.fusion import fit_launch_model

FORBID_CHAIN = ("labsim.experiments.fusion:bias_gelu_dropout_residual",
                "labsim.experiments.fusion:compile_and_time", "torch:compile")
# the fit is the exercise: no library least squares (a line through points is one of them)
FORBID_FIT = ("labsim.fusion:*", "numpy:polyfit", "numpy.linalg:lstsq", "numpy.linalg:pinv",
              "numpy.polynomial.polynomial:polyfit", "numpy.polynomial:Polynomial",
              "statistics:linear_regression", "scipy.stats:linregress",
              "scipy.optimize:curve_fit", "scipy.optimize:least_squares")
LIBRARY_FIT_OPS = ("aten::linalg_lstsq", "aten::linalg_pinv", "aten::pinverse",
                   "aten::linalg_solve", "aten::linalg_inv")


def _own_least_squares(case: Case, out: Outcome) -> str | None:
    used = sorted(op for op in out.observed.get("ops", {}) if op in LIBRARY_FIT_OPS)
    if used:
        return (f"it solved the fit with {used[0]}: write the least-squares line yourself "
                "(the means of x and y, then slope = sum((x - mx)(y - my)) / sum((x - mx)^2))")
    return None


def _only_the_output(case: Case, out: Outcome) -> str | None:
    x = case.args[0]
    if case.kwargs.get("chunk_rows", 256) >= x.shape[0]:
        return None  # one block is the whole tensor
    full = x.numel()
    created = sum(1 for n in out.observed.get("largest_created", []) if n >= full)
    if created > 1:
        return (f"{created} full-size tensors were created; a fused chain creates only its "
                "output: work on row blocks and reuse one block-sized buffer")
    return None


def _fused_chain_cases() -> list[Case]:
    specs = [
        ("16 rows in blocks of 4", 16, 8, 0.1, 4, "float32"),
        ("37 rows, blocks of 8 (last block short)", 37, 16, 0.25, 8, "float32"),
        ("blocks larger than the tensor", 3, 5, 0.5, 64, "float32"),
        ("p = 0 (dropout keeps everything)", 9, 4, 0.0, 2, "float32"),
        ("float64", 12, 6, 0.3, 5, "float64"),
        ("one row", 1, 32, 0.1, 1, "float32"),
        ("256 x 64 in blocks of 32: only the output is full-size", 256, 64, 0.1, 32,
         "float32"),
    ]
    cases = []
    for seed, (name, rows, hidden, p, chunk, dtype) in enumerate(specs):
        inp = chain_inputs(rows, hidden, p=p, seed=seed, dtype=getattr(torch, dtype))
        cases.append(Case(name, inp.args, {"chunk_rows": chunk},
                          bias_gelu_dropout_residual(*inp.args), close(1e-6, 1e-6)))
    return cases


fused_chain = Spec("fused_chain", _fused_chain_cases,
                   rules=(_only_the_output,), forbid=FORBID_CHAIN, torch_only=True)
"""``fn(x, bias, residual, keep, p, chunk_rows=256)`` equals the separate ops, and builds
no full-size intermediate (only its output)."""


def _launch_model_cases() -> list[Case]:
    def line(launch_s: float, bw: float, sizes: list[float]) -> list[float]:
        return [launch_s + s / bw for s in sizes]

    sizes = [1e3, 1e5, 1e6, 1e7, 1e8]
    exact = [(5e-6, 10e9), (20e-6, 2e12), (0.0, 1e9), (1e-3, 50e9)]
    cases = [
        Case(f"exact line: launch {ls * 1e6:g} us, {bw / 1e9:g} GB/s",
             (sizes, line(ls, bw, sizes)), {}, (ls, bw))
        for ls, bw in exact
    ]
    noisy_t = [t * f for t, f in zip(line(5e-6, 10e9, sizes), (1.02, 0.97, 1.01, 1.0, 1.0))]
    cases.append(Case("slightly noisy measurements (least squares)", (sizes, noisy_t), {},
                      fit_launch_model(sizes, noisy_t)))
    cases.append(Case("two points", ([0.0, 4e6], [3e-6, 3e-6 + 4e6 / 8e9]), {}, (3e-6, 8e9)))
    cases.append(Case("one size only: cannot separate the terms -> ValueError",
                      ([1e6, 1e6], [1e-4, 1.1e-4]), {}, None, raises(ValueError)))
    return cases


launch_model = Spec("launch_model", _launch_model_cases, compare=close(1e-6, 1e-12),
                    rules=(_own_least_squares,), forbid=FORBID_FIT)
"""``fn(nbytes, times_s) -> (launch_s, bandwidth_Bps)``: least-squares line fit."""
