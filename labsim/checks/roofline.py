"""Checks for the roofline lab: FLOP and byte counts, roofline time, MFU.

Every reference is labsim's own closed form (``labsim.roofline``), so the course and the
library cannot drift apart; the learner's functions must not call it (tripwired).
"""

from __future__ import annotations

from typing import Any

from labsim.checks._core import Case, Outcome, Spec, close, raises
from labsim.roofline import Roofline
from labsim.roofline import matmul_bytes as _matmul_bytes
from labsim.roofline import matmul_flops as _mm_flops

FORBID = ("labsim.roofline:*",)


def _rooflines() -> dict[str, Roofline]:
    return {"cpu": Roofline("a 2-core CPU", 100e9, 20e9),
            "h100": Roofline.of("H100-SXM", "bf16"), "a100": Roofline.of("A100-80GB", "bf16")}


def _matmul_flops_cases() -> list[Case]:
    shapes = [(1, 1, 1), (2, 3, 4), (4, 3, 2), (1, 4096, 4096), (4096, 4096, 4096),
              (0, 7, 9), (8192, 1, 1024)]
    return [Case(f"m, n, k = {s}", s, expected=_mm_flops(*s)) for s in shapes]


matmul_flops = Spec("matmul_flops", _matmul_flops_cases, compare=close(rtol=0), forbid=FORBID)
"""``fn(m, n, k)`` = FLOPs of (m x k) @ (k x n): 2mnk."""


def _matmul_bytes_cases() -> list[Case]:
    shapes = [(1, 1, 1, 4), (2, 3, 4, 4), (2, 3, 4, 2), (4096, 4096, 4096, 2),
              (1, 4096, 4096, 4), (8192, 1, 1024, 1), (0, 5, 5, 4)]
    return [Case(f"m, n, k, dtype_bytes = {s}", s, expected=_matmul_bytes(*s)) for s in shapes]


matmul_bytes = Spec("matmul_bytes", _matmul_bytes_cases, compare=close(rtol=0), forbid=FORBID)
"""``fn(m, n, k, dtype_bytes)`` = bytes to read A and B and write C once."""


def _roofline_time_cases() -> list[Case]:
    r = _rooflines()
    work = [
        ("compute-bound matmul on an H100", _mm_flops(8192, 8192, 8192),
         _matmul_bytes(8192, 8192, 8192, 2), r["h100"]),
        ("memory-bound fp32 add on an H100", 1e8, 12e8, r["h100"]),
        ("matrix-vector on an A100", _mm_flops(1, 4096, 4096),
         _matmul_bytes(1, 4096, 4096, 2), r["a100"]),
        ("exactly at the ridge point", 100e9, 20e9, r["cpu"]),
        ("no FLOPs at all (a copy)", 0.0, 4e9, r["cpu"]),
        ("no bytes (all in registers)", 1e12, 0.0, r["cpu"]),
    ]
    return [Case(name, (f, b, roof.peak_flops, roof.bandwidth_Bps), expected=roof.op_time(f, b))
            for name, f, b, roof in work]


roofline_time = Spec("roofline_time", _roofline_time_cases, compare=close(rtol=1e-9), forbid=FORBID)
"""``fn(flops, nbytes, peak_flops, bandwidth_Bps)`` = max(flops/peak, nbytes/bandwidth)."""


def _attainable_flops_cases() -> list[Case]:
    r = _rooflines()
    h100, a100, cpu = r["h100"], r["a100"], r["cpu"]
    return [
        Case(f"I = {i} FLOP/byte on {roof.name}", (i, roof.peak_flops, roof.bandwidth_Bps),
             expected=roof.attainable_flops(i))
        for i, roof in [(0.0, h100), (1 / 12, h100), (h100.ridge_point, h100), (1e4, h100),
                        (50.0, a100), (1.0, cpu), (5.0, cpu)]
    ]


attainable_flops = Spec("attainable_flops", _attainable_flops_cases, compare=close(rtol=1e-9),
                        forbid=FORBID)
"""``fn(intensity, peak_flops, bandwidth_Bps)`` = min(peak, intensity * bandwidth)."""


def _mfu_cases() -> list[Case]:
    good = [
        ("Megatron 1T on A100: 122 TFLOP/s of model FLOPs", 163e12 * 72 / 96, 1.0, 312e12),
        ("PaLM-like step: 46 % ", 0.462 * 275e12 * 2.5, 2.5, 275e12),
        ("an idle step", 0.0, 1.0, 312e12),
        ("tiny CPU step", 3e9, 0.05, 100e9),
    ]
    cases = [Case(n, (f, t, p), expected=f / t / p) for n, f, t, p in good]
    return cases + [
        Case("zero step time raises ValueError", (1e9, 0.0, 1e12), compare=raises(ValueError)),
        Case("negative peak raises ValueError", (1e9, 1.0, -1.0), compare=raises(ValueError)),
    ]


mfu = Spec("mfu", _mfu_cases, compare=close(rtol=1e-9), forbid=FORBID)
"""``fn(model_flops, step_time_s, peak_flops)`` = achieved model FLOP/s over peak; a
non-positive time or peak must raise ValueError."""


def _mlp_step_flops_cases() -> list[Case]:
    specs = [([4, 3], 1), ([4, 3], 10), ([512, 2048, 512], 64), ([10, 10, 10, 10], 7),
             ([784, 256, 10], 128), ([1, 1], 1)]
    return [Case(f"sizes={s}, batch={b}", (s, b),
                 expected=6 * b * sum(i * o for i, o in zip(s[:-1], s[1:])))
            for s, b in specs]


mlp_step_flops = Spec("mlp_step_flops", _mlp_step_flops_cases, compare=close(rtol=0), forbid=FORBID)
"""``fn(sizes, batch)`` = model FLOPs of one training step of an MLP with layer widths
``sizes`` (Linear(sizes[i], sizes[i+1]) for each i): 3 x forward = 6 * batch * sum(in*out)."""


# -- the benchmark timer: warm-up, synchronisation, repeats -------------------------------

def _benchmark_cases() -> list[Case]:
    # (seconds of work per call, extra seconds on the very first call, warmup, repeat)
    specs = [(0.02, 0.2, 1, 3), (0.01, 0.3, 2, 5), (0.03, 0.15, 1, 2), (0.005, 0.2, 3, 4),
             (0.02, 0.0, 0, 3)]
    return [Case(f"{job * 1e3:g} ms of queued work per call, first call +{first * 1e3:g} ms, "
                 f"warmup={w}, repeat={r}", (job, first), {"warmup": w, "repeat": r},
                 expected={"calls": w + r, "samples": r, "job_s": job}, compare=_timing_compare)
            for job, first, w, r in specs]


def _warmed_up(case: Case, out: Outcome) -> str | None:
    if out.observed["calls"] != case.expected["calls"]:
        return (f"fn was called {out.observed['calls']} times; warmup + repeat = "
                f"{case.expected['calls']}: warm up (untimed) first, then time each repeat")
    return None


def _synchronised(case: Case, out: Outcome) -> str | None:
    job, times = case.expected["job_s"], out.value
    for i, t in enumerate(times if isinstance(times, list) else []):
        if not isinstance(t, int | float) or t < 0.8 * job:
            return (f"sample {i} is {t!r} s for {job} s of queued work: the clock was read "
                    "before the device finished: call sync() before reading it")
        if t > job + 0.08:
            return (f"sample {i} is {t:.3f} s for {job} s of work: it includes earlier work "
                    "(the warm-up's, or the previous call's): sync() before starting the clock")
    return None


def _timing_compare(got: Any, expected: dict) -> str | None:
    if not isinstance(got, list) or len(got) != expected["samples"]:
        return f"returned {got!r}; return a list of {expected['samples']} times in seconds"
    return None


def _drive_benchmark(fns: Any, cases: Any, spec: Spec) -> list[Outcome]:
    from labsim.checks._core import plain_outcome
    from labsim.checks._observe import watch
    from labsim.lab.device import AsyncQueue

    outcomes = []
    for case in cases:
        job, first = case.args
        device = AsyncQueue()
        calls = [0]

        def fn(device: AsyncQueue = device, calls: list[int] = calls, job: float = job,
               first: float = first) -> None:
            device.launch(job + (first if calls[0] == 0 else 0.0))
            calls[0] += 1

        with watch(spec.forbid, ops=False) as seen:
            try:
                times = fns[0](fn, sync=device.synchronize, **dict(case.kwargs))
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                outcomes.append(Outcome.of_error(exc, seen.summary()))
                device.close()
                continue
        device.close()
        value = list(times) if isinstance(times, list | tuple) else times
        outcomes.append(plain_outcome(value, {**seen.summary(), "calls": calls[0]}))
    return outcomes


benchmark = Spec("benchmark", _benchmark_cases, drive=_drive_benchmark,
                 rules=(_warmed_up, _synchronised),
                 forbid=("labsim.lab.device:time_fn", "labsim.lab.device:time_queued"),
                 ops=False)
"""``fn(call, *, sync, warmup=1, repeat=5) -> list[float]``: ``warmup`` untimed calls, then
``repeat`` timed ones, each with ``sync()`` before the clock starts and before it is read;
checked on an ``AsyncQueue`` (a simulated asynchronous device) whose first call is slow."""
