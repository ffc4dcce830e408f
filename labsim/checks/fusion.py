"""Checks for the kernel-fusion lab: the chain as one Triton kernel, and the launch model.

``fused_chain`` is the learner's wrapper around their ``@triton.jit`` kernel.  It must equal
the separate operators (``bias_gelu_dropout_residual``, which it must not call) with the
dropout mask ``tl.rand(seed, i) > p`` draws (``labsim.experiments.fusion.dropout_keep``, the
same numbers, computed in the grader's process) on sizes that are not multiples of the block,
in fp32, fp16 and bf16; launch one Triton kernel per call with one program per block
(``labsim.lab.launches`` records launches); stay inside its tensors (the interpreter's loads
and stores are bounds-checked before they touch memory, and every tensor the wrapper allocates
is followed by guard elements a stray store would overwrite); and run no torch operator of
its own but allocating the output (the dispatcher recorder sees them).  On a CPU the kernel
runs in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported); on a GPU
it is compiled and the cases' tensors move to the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome, raises, time_limit
from labsim.checks._observe import watch
from labsim.experiments.fusion import bias_gelu_dropout_residual, chain_inputs, dropout_keep
from labsim.fusion import fit_launch_model

FORBID_CHAIN = ("labsim.experiments.fusion:bias_gelu_dropout_residual",
                "labsim.experiments.fusion:compile_and_time", "torch:compile")
FORBID_KERNEL = (*FORBID_CHAIN, "labsim.experiments.fusion:triton_rand",
                 "labsim.experiments.fusion:dropout_keep")
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
        return (f"it solved the fit with {used[0]}: write the least-squares line yourself, "
                "from the two normal equations of its intercept and slope")
    return None


# What the wrapper around the kernel may run itself: allocate the output and take views.
WRAPPER_OPS = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided", "aten::zeros", "aten::zeros_like", "aten::new_zeros",
    "aten::zero_", "aten::fill_", "aten::view", "aten::_unsafe_view", "aten::reshape",
    "aten::as_strided", "aten::alias", "aten::detach", "aten::expand", "aten::unsqueeze",
    "aten::squeeze", "aten::flatten", "aten::contiguous", "aten::slice", "aten::select",
    "aten::t", "aten::transpose", "aten::permute", "aten::lift_fresh",
})
PAD_ELEMENTS = 4096  # guard elements after every tensor the wrapper allocates
SENTINEL = -1234.5   # what they hold (exact in fp16 and bf16 too)
TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (2e-2, 2e-2)}


def _chain_case(name: str, rows: int, hidden: int, p: float, seed: int, block: int,
                dtype: str) -> Case:
    """Inputs in ``dtype``; the expected output computed in fp32 from the values the kernel
    reads, with the mask ``tl.rand(seed, i) > p`` draws, rounded to ``dtype``."""
    inp = chain_inputs(rows, hidden, p=p, seed=rows * 1000 + hidden)
    x, bias, residual = (t.to(getattr(torch, dtype)) for t in (inp.x, inp.bias, inp.residual))
    keep = dropout_keep(seed, (rows, hidden), p)
    expected = bias_gelu_dropout_residual(x.float(), bias.float(), residual.float(), keep, p)
    return Case(name, (x, bias, residual, p, seed, block), {}, expected.to(x.dtype),
                _same_dtype_close(*TOLERANCE[dtype]))


def _same_dtype_close(rtol: float, atol: float) -> Callable[[Any, Any], str | None]:
    near = close(rtol, atol)

    def compare(got: Any, expected: Any) -> str | None:
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.dtype != expected.dtype:
            return (f"dtype {str(got.dtype).replace('torch.', '')} instead of "
                    f"{str(expected.dtype).replace('torch.', '')}: the output has the "
                    "inputs' dtype")
        return near(got, expected)

    return compare


def _fused_chain_cases() -> list[Case]:
    return [
        _chain_case("600 elements in blocks of 256 (a tail of 88)", 2, 300, 0.1, 7, 256,
                    "float32"),
        _chain_case("p = 0: dropout keeps everything", 3, 100, 0.0, 1, 128, "float32"),
        _chain_case("one partial block: 1000 elements, blocks of 1024, p = 0.5", 1, 1000,
                    0.5, 2024, 1024, "float32"),
        _chain_case("512 elements in blocks of 128: no tail", 4, 128, 0.25, 3, 128,
                    "float32"),
        _chain_case("hidden 1: one bias for every row", 50, 1, 0.3, 11, 32, "float32"),
        _chain_case("a seed above 2**32", 4, 96, 0.2, 2**40 + 5, 128, "float32"),
        _chain_case("float16 in and out (compute in fp32)", 5, 77, 0.1, 5, 256, "float16"),
        _chain_case("bfloat16 in and out (compute in fp32)", 3, 64, 0.1, 9, 64, "bfloat16"),
    ]


class _PaddedAllocations(TorchDispatchMode):
    """Every tensor allocated while active is the front of a longer buffer whose tail holds
    ``SENTINEL``: a kernel that stores past the end of its output overwrites the tail (and
    nothing else), and ``overwritten()`` says so.  On a GPU, where nothing checks a compiled
    kernel's stores, this is what sees a tail left unmasked."""

    ALLOCATING = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                            "aten::new_empty", "aten::new_empty_strided", "aten::zeros",
                            "aten::zeros_like", "aten::new_zeros"})

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[tuple[torch.Tensor, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if (func._schema.name not in self.ALLOCATING or not isinstance(out, torch.Tensor)
                or out.numel() == 0 or not out.is_contiguous()):
            return out
        n = out.numel()
        buf = torch.empty(n + PAD_ELEMENTS, dtype=out.dtype, device=out.device)
        buf[n:] = SENTINEL
        front = buf[:n].view(out.shape)
        front.copy_(out)  # zeros stay zeros; empty stays arbitrary
        self.buffers.append((buf, n))
        return front

    def overwritten(self) -> int:
        """Elements past the end of an allocated tensor that no longer hold the sentinel."""
        return sum(int((buf[n:] != SENTINEL).sum()) for buf, n in self.buffers)


def _kernel_device() -> tuple[str, str | None]:
    """Where the learner's kernel runs: ("cpu", None) in Triton's interpreter, ("cuda", None)
    compiled for a GPU, or (device, reason) when Triton cannot run it here."""
    from labsim.lab.launches import interpreting, library_interpreted

    if interpreting():
        if not library_interpreted():
            return "cpu", ("TRITON_INTERPRET=1 was set after triton was imported, so "
                           "tl.rand cannot run in the interpreter: restart the kernel and "
                           "run the notebook from the top (the cell that sets it comes first)")
        return "cpu", None
    if torch.cuda.is_available():
        return "cuda", None
    return "cpu", ("Triton compiles for a GPU and there is none here: set "
                   "os.environ['TRITON_INTERPRET'] = '1' before importing triton")


def _warm_dispatch() -> None:
    """Dispatch one operator under a torch function mode and dispatch modes before any case
    runs: the first one imports ``torch._dynamo`` and what it needs (hundreds of modules).
    Done inside the first case, that import would count against its time limit, and under the
    reference tripwire's profile hook and a graded run's audit hook it takes a minute on a
    busy two-core machine; here it takes seconds."""
    from labsim.lab.profile import OpLog

    with _PassThrough(), OpLog(), _PaddedAllocations():
        torch.empty(1).add_(1)


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A torch function mode that only calls the function (for ``_warm_dispatch``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


def _unwrapped(exc: BaseException) -> BaseException:
    """The learner's own error inside Triton's ``InterpreterError`` wrapper."""
    while type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _drive_fused_chain(fns: Sequence[Callable[..., Any]], cases: Sequence[Case],
                       spec: Spec) -> list[Outcome]:
    """Each case: the inputs on the kernel's device, the call watched (operators, references,
    threads) with every Triton launch recorded and, in the interpreter, every load and store
    bounds-checked (``labsim.lab.launches``), the allocations padded; the value back on the
    CPU with what the launches did."""
    from labsim.lab.launches import LaunchLog

    device, unusable = _kernel_device()
    if unusable is None:
        _warm_dispatch()
    outcomes = []
    for case in cases:
        if unusable is not None:
            outcomes.append(Outcome.of_error(RuntimeError(unusable)))
            continue
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args)
        before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
        error: BaseException | None = None
        value: Any = None
        with LaunchLog(bounds=True) as launches, _PaddedAllocations() as pads:
            with watch(spec.forbid, ops=True, functions=True) as seen:
                try:
                    with time_limit(spec.case_seconds):
                        value = fns[0](*args, **dict(case.kwargs))
                    if device == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                    error = _unwrapped(exc)
            past_end = pads.overwritten()
        after = [a for a in args if isinstance(a, torch.Tensor)]
        observed = {**seen.summary(),
                    "launches": [[lc.kernel, lc.programs] for lc in launches.launches],
                    "out_of_bounds": list(launches.out_of_bounds), "past_the_end": past_end,
                    "inputs_changed": [i for i, (b, a) in enumerate(zip(before, after))
                                       if not torch.equal(b, a)]}
        if launches.out_of_bounds:  # judged by the rule, on every case alike
            outcomes.append(Outcome(None, observed=observed))
        elif error is not None:
            outcomes.append(Outcome.of_error(error, observed))
        else:
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().clone()
            outcomes.append(plain_outcome(value, observed))
    return outcomes


def _launched_once(case: Case, out: Outcome) -> str | None:
    launches = out.observed.get("launches", [])
    if not launches:
        return ("it launched no Triton kernel: write the chain as one @triton.jit kernel and "
                "launch it from the wrapper, kernel[grid](...)")
    if len(launches) > 1:
        names = ", ".join(str(k) for k, _ in launches[:4])
        return (f"it launched {len(launches)} Triton kernels per call ({names}): fuse every "
                "step into one kernel, launched once")
    return None


def _one_program_per_block(case: Case, out: Outcome) -> str | None:
    launches = out.observed.get("launches", [])
    if len(launches) != 1:
        return None  # _launched_once says why
    kernel, programs = launches[0]
    numel, block = case.args[0].numel(), case.args[5]
    want = -(-numel // block)
    if programs != want:
        return (f"{kernel} ran {programs} programs for {numel} elements in blocks of {block}: "
                f"launch one program per block, triton.cdiv(n_elements, BLOCK_SIZE) = {want}")
    return None


def _inside_the_tensors(case: Case, out: Outcome) -> str | None:
    bad = out.observed.get("out_of_bounds") or []
    if bad:
        return (f"{bad[0]}: the last block runs past the end of the tensors; mask it "
                "(offsets < n_elements) in every tl.load and tl.store")
    past = out.observed.get("past_the_end", 0)
    if past:
        return (f"it wrote {past} element(s) past the end of its output: mask the last "
                "block's tail (offsets < n_elements) in tl.store")
    return None


def _only_the_kernel_computes(case: Case, out: Outcome) -> str | None:
    ops = sorted(op for op in out.observed.get("ops", {}) if op not in WRAPPER_OPS)
    if ops:
        return (f"it ran torch operators on the tensors itself ({', '.join(ops[:3])}): the "
                "wrapper only allocates the output and launches the kernel, which computes "
                "every step")
    changed = out.observed.get("inputs_changed") or []
    if changed:
        return (f"it changed its input number {changed[0] + 1}: write the result into a new "
                "output tensor")
    return None


fused_chain = Spec("fused_chain", _fused_chain_cases, drive=_drive_fused_chain,
                   rules=(_launched_once, _one_program_per_block, _inside_the_tensors,
                          _only_the_kernel_computes),
                   forbid=FORBID_KERNEL, torch_only=True, case_seconds=60.0)
"""``fn(x, bias, residual, p, seed, block_size)``: ``residual + dropout(gelu(x + bias))`` by
one Triton kernel, launched once with one program per ``block_size`` elements; element ``i``
kept when ``tl.rand(seed, i) > p``."""


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
