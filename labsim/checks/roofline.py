"""Checks for the roofline lab: a matmul's FLOPs and bytes, a benchmark timer, a measured
roofline with ops placed on it, a training step's FLOPs counted forward and backward, and the
MFU and HFU of a measured step.

The counts are judged against labsim's closed forms (``labsim.roofline``, ``labsim.workload``)
and the grader's own count of the matrix products a step runs (``counted_flops``, read off the
dispatcher); the learner's functions must not call them (tripwired).  Every measurement is
judged on a *virtual* device (``labsim.lab.AsyncQueue(virtual=True)``): the check hands the
learner's function a timer whose samples the check chose -- a slow first call, samples a few
per cent apart and one four times too slow, as on a busy machine -- so the right answer is the
one derived from those samples, whatever else the machine is doing.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable
from typing import Any

from labsim.checks._core import Case, Outcome, Spec, close, raises
from labsim.roofline import Roofline
from labsim.roofline import matmul_bytes as _matmul_bytes
from labsim.roofline import matmul_flops as _mm_flops

FORBID = ("labsim.roofline:*",)

# -- a matmul's FLOPs and bytes ------------------------------------------------------------


def _matmul_cost_cases() -> list[Case]:
    shapes = [(1, 1, 1, 4), (2, 3, 4, 4), (4, 3, 2, 2), (4096, 4096, 4096, 2),
              (1, 4096, 4096, 4), (8192, 1, 1024, 1), (0, 5, 5, 4)]
    return [Case(f"m, n, k, dtype_bytes = {s}", s,
                 expected=(_mm_flops(*s[:3]), _matmul_bytes(*s))) for s in shapes]


matmul_cost = Spec("matmul_cost", _matmul_cost_cases, compare=close(rtol=0), forbid=FORBID)
"""``fn(m, n, k, dtype_bytes) -> (flops, nbytes)`` of (m x k) @ (k x n): 2mnk FLOPs, and the
bytes to read A and B and write C once."""


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


# -- the virtual device the measuring checks hand the learner --------------------------------

# The samples of one timed op, as multiples of its median: five consecutive calls always hold
# these five factors (in some order), so the median is SAMPLE_FACTORS' median whatever calls
# came before; the minimum, the mean and the first, middle or last sample are not.  The first
# call of an op takes FIRST_CALL times as long (a warm-up's one-time work).
SAMPLE_FACTORS = (1.03, 1.0, 4.0, 0.97, 0.99)
FIRST_CALL = 3.0
TIMER_WARMUP, TIMER_REPEAT = 1, len(SAMPLE_FACTORS)


class VirtualDevice:
    """A simulated asynchronous device with its own clock (``AsyncQueue(virtual=True)``) whose
    jobs take the times the check scheduled, and the timer the check hands the learner.

    ``job(median_s)`` is a call that queues one run of a job whose samples have median
    ``median_s``; ``timer(fn)`` is what a learner's ``timer`` argument does: one warm-up call,
    then ``TIMER_REPEAT`` calls each timed between two synchronisations on the device's clock,
    returned as a list of seconds.  ``timed[name]`` counts the calls of each job made inside
    the timer."""

    def __init__(self) -> None:
        from labsim.lab.device import AsyncQueue

        self.queue = AsyncQueue(virtual=True)
        self.timed: dict[str, int] = {}
        self._in_timer = False

    def job(self, name: str, median_s: float) -> Callable[[], None]:
        calls = [0]
        scale = median_s / statistics.median(SAMPLE_FACTORS)
        self.timed.setdefault(name, 0)

        def run() -> None:
            i = calls[0]
            calls[0] += 1
            factor = FIRST_CALL if i == 0 else SAMPLE_FACTORS[(i - 1) % len(SAMPLE_FACTORS)]
            self.queue.launch(scale * factor)
            if self._in_timer:
                self.timed[name] += 1

        return run

    def timer(self, fn: Callable[[], Any]) -> list[float]:
        """Seconds of ``TIMER_REPEAT`` synchronised calls of ``fn()`` after ``TIMER_WARMUP``."""
        self._in_timer = True
        try:
            for _ in range(TIMER_WARMUP):
                fn()
            times = []
            for _ in range(TIMER_REPEAT):
                self.queue.synchronize()
                start = self.queue.clock()
                fn()
                self.queue.synchronize()
                times.append(self.queue.clock() - start)
            return times
        finally:
            self._in_timer = False

    def close(self) -> None:
        self.queue.close()


# -- this machine's roofline, measured, and ops placed on it --------------------------------

ON_ROOF, IN_CACHE = 0.5, 1.5


def place_measured(roof: dict, slope: dict, ops: list[dict], on_roof: float = ON_ROOF,
                   in_cache: float = IN_CACHE) -> dict[str, Any]:
    """The reference placement from measured median times: each of ``roof``, ``slope`` and
    ``ops`` is ``{"name", "flops", "nbytes", "seconds"}`` with ``seconds`` the median of its
    samples.  Peak FLOP/s = the roof op's FLOPs over its time; bandwidth = the slope op's bytes
    over its time.  Per op: the roofline's time ``max(flops / peak, nbytes / bandwidth)``, the
    fraction of it the op reached (roofline time / measured time), the bound the roofline
    predicts (``"compute"`` when ``flops / peak >= nbytes / bandwidth``, as
    ``Roofline.bound``) and the one the measurement shows: ``"below"`` under ``on_roof`` of the
    roofline (neither roof explains the time), ``"cache"`` over ``in_cache`` times the memory
    slope (faster than the measured memory can move its bytes), else the roofline's."""
    peak = roof["flops"] / roof["seconds"]
    bandwidth = slope["nbytes"] / slope["seconds"]
    placed = {}
    for op in ops:
        t = op["seconds"]
        bound = "compute" if op["flops"] / peak >= op["nbytes"] / bandwidth else "memory"
        fraction = max(op["flops"] / peak, op["nbytes"] / bandwidth) / t
        measured = ("below" if fraction < on_roof
                    else "cache" if bound == "memory" and fraction > in_cache else bound)
        placed[op["name"]] = {"time_s": t, "intensity": op["flops"] / op["nbytes"],
                              "achieved_flops": op["flops"] / t, "fraction": fraction,
                              "roofline": bound, "measured": measured}
    return {"peak_flops": peak, "bandwidth_Bps": bandwidth, "ops": placed}


def _work(name: str, flops: float, nbytes: float) -> dict[str, Any]:
    return {"name": name, "flops": flops, "nbytes": nbytes}


def _matmul(name: str, m: int, n: int, k: int, dtype_bytes: int) -> dict[str, Any]:
    return _work(name, _mm_flops(m, n, k), _matmul_bytes(m, n, k, dtype_bytes))


def _add(name: str, numel: int, dtype_bytes: int) -> dict[str, Any]:
    return _work(name, numel, 3 * numel * dtype_bytes)


def _copy(name: str, numel: int, dtype_bytes: int) -> dict[str, Any]:
    return _work(name, 0, 2 * numel * dtype_bytes)


def _timed_at(work: dict[str, Any], fraction: float, machine: Roofline) -> dict[str, Any]:
    """``work`` with the median time at which it reaches ``fraction`` of ``machine``'s
    roofline."""
    best = max(work["flops"] / machine.peak_flops, work["nbytes"] / machine.bandwidth_Bps)
    return {**work, "seconds": best / fraction}


def _placement_case(name: str, machine: Roofline, roof: dict, slope: dict,
                    ops: list[tuple[dict, float]], **kwargs: float) -> Case:
    roof = {**roof, "seconds": roof["flops"] / machine.peak_flops}
    slope = {**slope, "seconds": slope["nbytes"] / machine.bandwidth_Bps}
    timed = [_timed_at(work, fraction, machine) for work, fraction in ops]
    return Case(name, (roof, slope, timed), dict(kwargs),
                expected=place_measured(roof, slope, timed, **kwargs))


def _place_cases() -> list[Case]:
    cpu = Roofline("a 2-core CPU", 100e9, 20e9)  # ridge 5 FLOP/byte
    slow = Roofline("a slow CPU", 5e9, 2e9)  # ridge 2.5 FLOP/byte
    h100 = Roofline.of("H100-SXM", "bf16")
    cpu_roof, cpu_slope = _matmul("matmul 1024", 1024, 1024, 1024, 4), _copy("copy 2^25", 2**25, 4)
    mm1024, mm16 = _matmul("matmul 1024", 1024, 1024, 1024, 4), _matmul("matmul 16", 16, 16, 16, 4)
    matvec = _matmul("matrix-vector 4096", 1, 4096, 4096, 4)
    add_big, add_small = _add("add 2^24", 2**24, 4), _add("add 2^14", 2**14, 4)
    return [
        _placement_case("a CPU (100 GFLOP/s, 20 GB/s): on the roof, on the slope, in cache, "
                        "below both", cpu, cpu_roof, cpu_slope,
                        [(mm1024, 0.8), (matvec, 0.7), (add_big, 0.9), (add_small, 3.0),
                         (mm16, 0.05)]),
        _placement_case("the same ops measured at other speeds: the measurement decides",
                        cpu, cpu_roof, cpu_slope,
                        [(mm1024, 0.3), (matvec, 2.5), (add_big, 1.2), (add_small, 0.4),
                         (mm16, 0.6)]),
        _placement_case("an H100 in bf16 (989 TFLOP/s, 3.35 TB/s)", h100,
                        _matmul("matmul 8192", 8192, 8192, 8192, 2), _copy("copy 2^30", 2**30, 2),
                        [(_matmul("matmul 8192", 8192, 8192, 8192, 2), 0.7),
                         (_matmul("matmul 4096 x 4096 x 128", 4096, 4096, 128, 2), 0.75),
                         (_matmul("decode: 1 x 12288 x 12288", 1, 12288, 12288, 2), 0.85),
                         (_add("add 2^26", 2**26, 2), 0.6), (_matmul("matmul 64", 64, 64, 64, 2),
                                                              0.01)]),
        _placement_case("thresholds on_roof=0.3, in_cache=3.0", cpu, cpu_roof, cpu_slope,
                        [(mm1024, 0.35), (add_big, 2.5), (add_small, 3.2), (matvec, 0.25)],
                        on_roof=0.3, in_cache=3.0),
        _placement_case("near the thresholds; a copy; an op above the measured roof", cpu,
                        cpu_roof, cpu_slope,
                        [(_add("add 2^20 at 49 %", 2**20, 4), 0.49),
                         (_add("add 2^20 at 51 %", 2**20, 4), 0.51),
                         (_add("add 2^18 at 149 %", 2**18, 4), 1.49),
                         (_add("add 2^18 at 151 %", 2**18, 4), 1.51),
                         (_copy("copy 2^22", 2**22, 4), 0.95), (mm1024, 1.2)]),
        _placement_case("a slow CPU (5 GFLOP/s, 2 GB/s): matmul 16 is compute-bound there",
                        slow, _matmul("matmul 512", 512, 512, 512, 4), cpu_slope,
                        [(mm16, 0.9), (matvec, 0.8), (add_big, 0.55)]),
    ]


def _every_op_timed(case: Case, out: Outcome) -> str | None:
    timed = out.observed.get("timed", {})
    missed = [name for name, calls in timed.items() if calls == 0]
    if missed:
        return (f"{missed[0]} was never run through `timer`: place every op, the roof and "
                "the slope from the times `timer` measures")
    return None


def _drive_place(fns: Any, cases: Any, spec: Spec) -> list[Outcome]:
    from labsim.checks._core import plain_outcome
    from labsim.checks._observe import watch
    from labsim.experiments.roofline import Op

    outcomes = []
    for case in cases:
        roof, slope, timed = case.args
        device = VirtualDevice()

        def op(work: dict, role: str, device: VirtualDevice = device) -> Op:
            run = device.job(f"{role} `{work['name']}`", work["seconds"])
            return Op(work["name"], run, work["flops"], work["nbytes"])

        args = (op(roof, "the roof op"), op(slope, "the slope op"),
                [op(w, "op") for w in timed])
        with watch(spec.forbid, ops=False) as seen:
            try:
                value = fns[0](args[2], args[0], args[1], device.timer, **dict(case.kwargs))
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error: BaseException | None = exc
            else:
                error = None
        device.close()
        observed = {**seen.summary(), "timed": dict(device.timed)}
        outcomes.append(Outcome.of_error(error, observed) if error is not None
                        else plain_outcome(value, observed))
    return outcomes


place_on_roofline = Spec("place_on_roofline", _place_cases, drive=_drive_place,
                         compare=close(rtol=1e-6), rules=(_every_op_timed,),
                         forbid=(*FORBID, "labsim.checks.roofline:place_measured"), ops=False)
"""``fn(ops, roof, slope, timer, on_roof=0.5, in_cache=1.5) -> {"peak_flops", "bandwidth_Bps",
"ops": {name: {"time_s", "intensity", "achieved_flops", "fraction", "roofline",
"measured"}}}``: the roofline measured from the median times of ``roof`` (a large matmul:
peak FLOP/s) and ``slope`` (a large copy: bytes/s), each op of ``ops`` placed on it from its
median time (see ``place_measured``).  Judged on a virtual device whose samples the check
chose, so only a placement derived from ``timer``'s samples passes."""


# -- a training step's FLOPs, counted ------------------------------------------------------

STEP_FORBID = ("labsim.workload:Transformer.flops_per_token",
               "labsim.workload:Transformer.flops_forward_per_token",
               "labsim.workload:Transformer.training_flops",
               "labsim.checks.roofline:counted_flops", "labsim.checks.roofline:_counted")


def _model(config: dict[str, Any]) -> tuple[Any, Callable[[], Any], int, int, Any]:
    """The model of a case's plain-data ``config`` (seeded, without touching the caller's
    random state): ``(model, loss_fn, n_params, tokens, optimizer or None)``.  ``loss_fn()``
    runs the forward pass and returns the loss.  A ``"gpt"`` is the lab GPT (tokens = batch x
    sequence); an ``"mlp"`` is Linear layers of widths ``sizes`` with GeLU between them, an
    MSE loss, inputs that require a gradient only if ``input_grad``, the Linear layers listed
    in ``frozen`` without gradients, and an SGD optimizer (tokens = batch)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if config["kind"] == "gpt":
            from labsim.lab.datasets import random_batch
            from labsim.lab.models import GPT
            from labsim.workload import Transformer

            cfg = Transformer(config["layers"], config["hidden"], config["heads"],
                              config["seq_len"], config["vocab"], tied_embeddings=True)
            model = GPT(cfg, recompute=config["recompute"])
            idx, targets = random_batch(cfg, batch=config["batch"], seed=0)

            def loss_fn(model: Any = model, idx: Any = idx, targets: Any = targets) -> Any:
                return model(idx, targets)[1]

            tokens, optimizer = idx.numel(), None
        else:
            sizes, batch = config["sizes"], config["batch"]
            layers: list[Any] = []
            for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers += [torch.nn.Linear(n_in, n_out), torch.nn.GELU()]
                if i in config.get("frozen", ()):
                    layers[-2].requires_grad_(False)
            model = torch.nn.Sequential(*layers[:-1])
            x = torch.randn(batch, sizes[0], requires_grad=config.get("input_grad", False))
            y = torch.randn(batch, sizes[-1])

            def loss_fn(model: Any = model, x: Any = x, y: Any = y) -> Any:
                return torch.nn.functional.mse_loss(model(x), y)

            tokens = batch
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                        lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    return model, loss_fn, n_params, tokens, optimizer


def counted_flops(config: dict[str, Any]) -> tuple[int, int]:
    """(forward, backward) FLOPs that one training step of the case's model really executes,
    recomputation included in the backward: 2 x (output elements) x (inner dimension) of every
    matrix product ATen runs (``mm``, ``addmm``, ``bmm``, ``baddbmm``), read off the
    dispatcher -- the grader's own count, independent of ``FlopCounterMode`` (the lab GPT's
    attention is written out, so every FLOP it counts is one of these)."""
    return _counted(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _counted(key: str) -> tuple[int, int]:
    """``counted_flops`` of the config whose JSON is ``key`` (each model counted once)."""
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

    _, loss_fn, _, _, _ = _model(json.loads(key))
    with _Matmuls() as forward:
        loss = loss_fn()
    with _Matmuls() as backward:
        loss.backward()
    return int(forward.flops), int(backward.flops)


def model_flops(config: dict[str, Any]) -> float:
    """Model FLOPs of one training step from the closed forms (3 x the forward): the lab
    GPT's ``Transformer.flops_per_token`` x tokens; an MLP's 6 x batch x sum(in x out)."""
    if config["kind"] == "gpt":
        from labsim.workload import Transformer

        cfg = Transformer(config["layers"], config["hidden"], config["heads"],
                          config["seq_len"], config["vocab"], tied_embeddings=True)
        return cfg.flops_per_token * config["batch"] * config["seq_len"]
    sizes = config["sizes"]
    return 6 * config["batch"] * sum(i * o for i, o in zip(sizes[:-1], sizes[1:]))


def _gpt(layers: int, hidden: int, heads: int, seq_len: int, vocab: int, batch: int,
         recompute: bool) -> dict[str, Any]:
    return {"kind": "gpt", "layers": layers, "hidden": hidden, "heads": heads,
            "seq_len": seq_len, "vocab": vocab, "batch": batch, "recompute": recompute}


def _mlp(sizes: list[int], batch: int, frozen: tuple[int, ...] = (),
         input_grad: bool = False) -> dict[str, Any]:
    return {"kind": "mlp", "sizes": sizes, "batch": batch, "frozen": list(frozen),
            "input_grad": input_grad}


def _describe(config: dict[str, Any]) -> str:
    if config["kind"] == "gpt":
        return (f"GPT l={config['layers']} h={config['hidden']} s={config['seq_len']} "
                f"V={config['vocab']} b={config['batch']}, "
                f"{'full recompute' if config['recompute'] else 'no recompute'}")
    extra = (f", Linear {config['frozen']} frozen" if config["frozen"] else "") + (
        ", input requires grad" if config["input_grad"] else "")
    return f"MLP {config['sizes']} b={config['batch']}{extra}"


STEP_MODELS = [_gpt(2, 64, 2, 32, 256, 2, False), _gpt(2, 64, 2, 32, 256, 2, True),
               _gpt(1, 96, 3, 64, 300, 1, True), _mlp([64, 256, 256, 32], 16),
               _mlp([48, 128, 128, 16], 8, frozen=(0,)), _mlp([32, 96, 8], 4, input_grad=True)]


def _count_step_cases() -> list[Case]:
    cases = []
    for config in STEP_MODELS:
        _, _, n_params, tokens, _ = _model(config)
        forward, backward = counted_flops(config)
        cases.append(Case(_describe(config), (config,), expected={
            "forward": forward, "backward": backward, "backward_per_forward": backward / forward,
            "flops_per_param_token": (forward + backward) / (n_params * tokens)}))
    return cases


def _drive_count_step(fns: Any, cases: Any, spec: Spec) -> list[Outcome]:
    from labsim.checks._core import plain_outcome
    from labsim.checks._observe import watch

    outcomes = []
    for case in cases:
        _, loss_fn, n_params, tokens, _ = _model(case.args[0])
        with watch(spec.forbid, ops=False) as seen:
            try:
                value = fns[0](loss_fn, n_params, tokens)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                outcomes.append(Outcome.of_error(exc, seen.summary()))
                continue
        outcomes.append(plain_outcome(value, seen.summary()))
    return outcomes


count_step = Spec("count_step", _count_step_cases, drive=_drive_count_step,
                  compare=close(rtol=1e-9), forbid=STEP_FORBID, ops=False)
"""``fn(loss_fn, n_params, tokens) -> {"forward", "backward", "backward_per_forward",
"flops_per_param_token"}``: the FLOPs ``FlopCounterMode`` counts in ``loss_fn()`` (the
forward) and in the backward of the loss it returns (recomputation included), their ratio,
and (forward + backward) / (n_params x tokens).  Judged against the grader's own count on
GPTs and MLPs the learner has not seen: with recomputation, a frozen layer, an input that
needs no gradient."""


# -- MFU and HFU of a measured step ----------------------------------------------------------

UTILISATION_FORBID = (*STEP_FORBID, "labsim.checks.roofline:model_flops")


def _utilisation_cases() -> list[Case]:
    # (model, median step time in s, peak FLOP/s)
    specs = [(_gpt(2, 64, 2, 32, 256, 2, False), 0.01, 100e9),
             (_gpt(2, 64, 2, 32, 256, 2, True), 0.01, 100e9),
             (_gpt(1, 128, 4, 128, 512, 1, True), 0.25, 312e12),
             (_gpt(3, 32, 2, 16, 128, 3, False), 1e-3, 19.5e12),
             (_mlp([64, 256, 256, 32], 16), 2e-3, 50e9)]
    cases = []
    for config, step_s, peak in specs:
        forward, backward = counted_flops(config)
        name = f"{_describe(config)}, step {step_s * 1e3:g} ms, peak {peak / 1e12:g} TFLOP/s"
        cases.append(Case(name, (config, step_s, peak), expected={
            "step_s": step_s, "mfu": model_flops(config) / step_s / peak,
            "hfu": (forward + backward) / step_s / peak}))
    cases.append(Case("a peak of 0 FLOP/s raises ValueError", (_mlp([8, 8], 2), 1e-3, 0.0),
                      compare=raises(ValueError)))
    return cases


def _drive_utilisation(fns: Any, cases: Any, spec: Spec) -> list[Outcome]:
    from labsim.checks._core import plain_outcome
    from labsim.checks._observe import watch

    outcomes = []
    for case in cases:
        config, step_s, peak = case.args
        model, loss_fn, _, _, optimizer = _model(config)
        device = VirtualDevice()
        tick = device.job("step", step_s)

        def step(model: Any = model, loss_fn: Any = loss_fn, optimizer: Any = optimizer,
                 tick: Callable[[], None] = tick) -> None:
            model.zero_grad(set_to_none=True)
            loss_fn().backward()
            if optimizer is not None:
                optimizer.step()
            tick()

        with watch(spec.forbid, ops=False) as seen:
            try:
                value = fns[0](loss_fn, step, device.timer, peak)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error: BaseException | None = exc
            else:
                error = None
        device.close()
        outcomes.append(Outcome.of_error(error, seen.summary()) if error is not None
                        else plain_outcome(value, seen.summary()))
    return outcomes


utilisation = Spec("utilisation", _utilisation_cases, drive=_drive_utilisation,
                   compare=close(rtol=1e-9), forbid=UTILISATION_FORBID, ops=False)
"""``fn(loss_fn, step, timer, peak_flops) -> {"step_s", "mfu", "hfu"}``: ``loss_fn()`` runs the
forward pass and returns the loss, ``step()`` a whole training step (forward, backward with
any recomputation, optimizer), ``timer(fn)`` a list of measured seconds of ``fn()``.  The
step time is the median of ``timer(step)``; model FLOPs are 3 x the FLOPs counted in the
forward, hardware FLOPs those counted in ``step()``; each per second of step time over
``peak_flops``; a peak that is not positive raises ValueError.  Judged on a virtual device
(the step's samples chosen by the check) against labsim's closed forms and the grader's own
count, on models the learner has not seen."""
