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
    # the device's clock is virtual: a timer read through ``clock`` measures the work exactly
    job, times = case.expected["job_s"], out.value
    for i, t in enumerate(times if isinstance(times, list) else []):
        if not isinstance(t, int | float) or t < job - 1e-9:
            hint = (" (and read the time with the `clock` you are given: the check's device "
                    "keeps its own)" if isinstance(t, int | float) and t < 1e-3 else "")
            return (f"sample {i} is {t!r} s for {job} s of queued work: the clock was read "
                    f"before the device finished: call sync() before reading it{hint}")
        if t > job + 1e-9:
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
        device = AsyncQueue(virtual=True)
        calls = [0]

        def fn(device: AsyncQueue = device, calls: list[int] = calls, job: float = job,
               first: float = first) -> None:
            device.launch(job + (first if calls[0] == 0 else 0.0))
            calls[0] += 1

        with watch(spec.forbid, ops=False) as seen:
            try:
                times = fns[0](fn, sync=device.synchronize, clock=device.clock,
                               **dict(case.kwargs))
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
"""``fn(call, *, sync, warmup=1, repeat=5, clock=time.perf_counter) -> list[float]``:
``warmup`` untimed calls, then ``repeat`` timed ones, each with ``sync()`` before the clock
starts and before it is read, the time read with ``clock()``; checked on an ``AsyncQueue``
with a virtual clock (a simulated asynchronous device whose first call is slow), so the
verdict is exact whatever else the machine is doing."""


# -- MFU and HFU of a GPT training step, from counted FLOPs --------------------------------

UTILISATION_FORBID = ("labsim.workload:Transformer.flops_per_token",
                      "labsim.workload:Transformer.flops_forward_per_token",
                      "labsim.workload:Transformer.training_flops",
                      "labsim.checks.roofline:executed_step_flops")


def _gpt_case(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The lab GPT of a case's plain-data ``config``, its batch and targets (seeded)."""
    import torch

    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT
    from labsim.workload import Transformer

    cfg = Transformer(config["layers"], config["hidden"], config["heads"], config["seq_len"],
                      config["vocab"], tied_embeddings=True)
    torch.manual_seed(0)
    model = GPT(cfg, recompute=config["recompute"])
    idx, targets = random_batch(cfg, batch=config["batch"], seed=0)
    return model, idx, targets


def executed_step_flops(config: dict[str, Any]) -> int:
    """FLOPs one training step (forward, loss, backward) of the case's GPT really executes,
    recomputation included: 2 x (output elements) x (inner dimension) of every matrix
    product ATen runs (``mm``, ``addmm``, ``bmm``, ``baddbmm``), read off the dispatcher --
    the grader's own count, independent of ``FlopCounterMode`` (the lab GPT's attention is
    written out, so every FLOP it counts is one of these)."""
    import math

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    plain, fused = (aten.mm, aten.bmm), (aten.addmm, aten.baddbmm)

    class _Matmuls(TorchDispatchMode):
        flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            packet = func.overloadpacket
            if packet in plain or packet in fused:
                a = args[0] if packet in plain else args[1]
                self.flops += 2 * math.prod(out.shape) * a.shape[-1]
            return out

    model, idx, targets = _gpt_case(config)
    with _Matmuls() as counter:
        model(idx, targets)[1].backward()
    return int(counter.flops)


def _utilisation_cases() -> list[Case]:
    from labsim.workload import Transformer

    # (layers, hidden, heads, seq_len, vocab, batch, recompute, step time s, peak FLOP/s)
    specs = [(2, 64, 2, 32, 256, 2, False, 0.01, 100e9),
             (2, 64, 2, 32, 256, 2, True, 0.01, 100e9),
             (1, 128, 4, 128, 512, 1, True, 0.25, 312e12),
             (1, 96, 3, 64, 300, 1, False, 2e-3, 989.4e12),
             (3, 32, 2, 16, 128, 3, True, 1e-3, 19.5e12)]
    cases = []
    for layers, hidden, heads, seq, vocab, batch, recompute, t, peak in specs:
        config = {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq,
                  "vocab": vocab, "batch": batch, "recompute": recompute}
        cfg = Transformer(layers, hidden, heads, seq, vocab, tied_embeddings=True)
        model_flops = cfg.flops_per_token * batch * seq
        name = (f"GPT l={layers} h={hidden} s={seq} V={vocab} b={batch}, "
                f"{'full recompute' if recompute else 'no recompute'}, "
                f"{t * 1e3:g} ms, peak {peak / 1e12:g} TFLOP/s")
        cases.append(Case(name, (config, t, peak), expected={
            "mfu": model_flops / t / peak, "hfu": executed_step_flops(config) / t / peak}))
    config = {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 1,
              "recompute": False}
    cases.append(Case("a zero step time raises ValueError", (config, 0.0, 1e12),
                      compare=raises(ValueError)))
    return cases


def _drive_utilisation(fns: Any, cases: Any, spec: Spec) -> list[Outcome]:
    from labsim.checks._core import plain_outcome
    from labsim.checks._observe import watch

    outcomes = []
    for case in cases:
        config, t, peak = case.args
        model, idx, targets = _gpt_case(config)

        def forward(model: Any = model, idx: Any = idx, targets: Any = targets) -> Any:
            return model(idx, targets)[1]

        def step(model: Any = model, idx: Any = idx, targets: Any = targets) -> None:
            model.zero_grad(set_to_none=True)
            model(idx, targets)[1].backward()

        with watch(spec.forbid, ops=False) as seen:
            try:
                value = fns[0](forward, step, t, peak)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                outcomes.append(Outcome.of_error(exc, seen.summary()))
                continue
        outcomes.append(plain_outcome(value, seen.summary()))
    return outcomes


utilisation = Spec("utilisation", _utilisation_cases, drive=_drive_utilisation,
                   compare=close(rtol=1e-9), forbid=UTILISATION_FORBID, ops=False)
"""``fn(forward, step, step_time_s, peak_flops) -> {"mfu": ..., "hfu": ...}``: ``forward()``
runs the model's forward pass and returns the loss, ``step()`` runs a whole training step
(forward, backward; recomputation if the model checkpoints its blocks).  Model FLOPs are 3 x
the forward's counted FLOPs (the backward is twice the forward); hardware FLOPs are the
step's counted FLOPs; each over ``step_time_s`` over ``peak_flops``.  A non-positive time or
peak raises ValueError.  Judged against labsim's closed form (``Transformer.flops_per_token``)
and the grader's own count of the same step, on GPTs the learner has not seen."""
