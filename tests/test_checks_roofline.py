"""Lab 00's checks: the solution passes, honest variants pass, and every shortcut fails.

A shortcut is an answer that skips the skill: a count copied from a rule instead of counted, a
placement taken from the roofline instead of from what the timer measured, a time that is not
the median of the samples, labsim's own reference.
"""

from __future__ import annotations

import math
import re
import statistics
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labsim.checks import CheckFailed
from labsim.checks import roofline as check
from labsim.course.notebook import as_shown

from .solution_cells import exercises

S0 = exercises("00_why_gpus")
REFERENCE = "calls labsim's own reference"


def _stub(*args, **kwargs):
    raise NotImplementedError


def _passes(spec, fn, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    spec(fn)
    line = as_shown(capsys.readouterr().out).strip()
    assert re.fullmatch(rf"PASS {spec.title}: (\d+)/\1 cases passed", line), line


def _fails(spec, fn, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=re.compile(why, re.S)):
        spec(fn)


@pytest.mark.parametrize("name", [
    "matmul_cost", "benchmark", "place_on_roofline",
    pytest.param("count_step", marks=pytest.mark.slow),
    pytest.param("utilisation", marks=pytest.mark.slow)])
def test_the_solution_passes_and_the_stub_is_not_done(name: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    spec = getattr(check, name)
    _passes(spec, S0[name], capsys)
    _fails(spec, _stub, "not implemented")


# -- the one formula: a matmul's FLOPs and bytes ---------------------------------------------

@pytest.mark.parametrize("cheat", [
    lambda m, n, k, d: (m * n * k, (m * k + k * n + m * n) * d),  # a multiply-add is 2 FLOPs
    lambda m, n, k, d: (2 * m * n * k, (m * k + k * n) * d),  # forgot writing C
    lambda m, n, k, d: 2 * m * n * k,  # no bytes
], ids=["one-flop-per-fma", "no-output-bytes", "flops-only"])
def test_matmul_cost_shortcuts_fail(cheat) -> None:  # noqa: ANN001
    _fails(check.matmul_cost, cheat, "FAIL matmul_cost")


def test_matmul_cost_from_the_library_fails() -> None:
    from labsim.roofline import matmul_bytes, matmul_flops

    _fails(check.matmul_cost, lambda m, n, k, d: (matmul_flops(m, n, k),
                                                  matmul_bytes(m, n, k, d)), REFERENCE)


def test_matmul_cost_may_return_a_list(capsys: pytest.CaptureFixture) -> None:
    _passes(check.matmul_cost, lambda m, n, k, d: [2 * m * n * k, (m * k + k * n + m * n) * d],
            capsys)


# -- the measured roofline -------------------------------------------------------------------

def _placer(*, time_of=None, measured_of=None, fraction_of=None, thresholds=True):  # noqa: ANN001, ANN202
    """A learner's ``place_on_roofline`` with one step done its own way: ``time_of(op, timer)``
    the op's time, ``measured_of(bound, fraction, on_roof, in_cache)`` the measured bound,
    ``fraction_of(op, t, peak, bandwidth)`` the fraction of the roofline; ``thresholds=False``
    ignores the thresholds it is given."""

    def median_time(op, timer):  # noqa: ANN001, ANN202
        return statistics.median(timer(op.run))

    def measured(bound, fraction, on_roof, in_cache):  # noqa: ANN001, ANN202
        if fraction < on_roof:
            return "below"
        return "cache" if bound == "memory" and fraction > in_cache else bound

    def by_times(op, t, peak, bandwidth):  # noqa: ANN001, ANN202
        return max(op.flops / peak, op.nbytes / bandwidth) / t

    time_of = time_of or median_time
    measured_of = measured_of or measured
    fraction_of = fraction_of or by_times

    def place_on_roofline(ops, roof, slope, timer, on_roof=0.5, in_cache=1.5):  # noqa: ANN001, ANN202
        if not thresholds:
            on_roof, in_cache = 0.5, 1.5
        peak = roof.flops / time_of(roof, timer)
        bandwidth = slope.nbytes / time_of(slope, timer)
        placed = {}
        for op in ops:
            t = time_of(op, timer)
            bound = "compute" if op.flops / peak >= op.nbytes / bandwidth else "memory"
            fraction = fraction_of(op, t, peak, bandwidth)
            placed[op.name] = {"time_s": t, "intensity": op.flops / op.nbytes,
                               "achieved_flops": op.flops / t, "fraction": fraction,
                               "roofline": bound,
                               "measured": measured_of(bound, fraction, on_roof, in_cache)}
        return {"peak_flops": peak, "bandwidth_Bps": bandwidth, "ops": placed}

    return place_on_roofline


def _by_rates(op, t, peak, bandwidth):  # noqa: ANN001, ANN202
    """Achieved over attainable FLOP/s; a copy (no FLOPs) by its bytes."""
    if op.flops == 0:
        return op.nbytes / t / bandwidth
    return (op.flops / t) / min(peak, op.flops / op.nbytes * bandwidth)


def _twice(op, timer):  # noqa: ANN001, ANN202
    return statistics.median(timer(op.run) + timer(op.run))


def _wall_clock(op, timer):  # noqa: ANN001, ANN202
    op.run()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        op.run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@pytest.mark.parametrize("honest", [
    _placer(),
    _placer(fraction_of=_by_rates),
    _placer(time_of=_twice),
    _placer(time_of=lambda op, timer: sorted(timer(op.run))[2]),
    _placer(time_of=lambda op, timer: float(torch.tensor(timer(op.run)).median())),
], ids=["times", "rates", "ten-samples", "sorted-middle", "torch-median"])
def test_honest_placements_pass(honest, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    _passes(check.place_on_roofline, honest, capsys)


@pytest.mark.parametrize(("cheat", "why"), [
    (_placer(measured_of=lambda bound, fraction, on_roof, in_cache: bound), r"\['measured'\]"),
    (_placer(time_of=lambda op, timer: statistics.mean(timer(op.run))), r"\['time_s'\]|peak"),
    (_placer(time_of=lambda op, timer: min(timer(op.run))), r"\['time_s'\]|peak"),
    (_placer(time_of=lambda op, timer: timer(op.run)[-1]), r"\['time_s'\]|peak"),
    (_placer(time_of=lambda op, timer: timer(op.run)[0]), r"\['time_s'\]|peak"),
    (_placer(time_of=lambda op, timer: timer(op.run)[2]), r"\['time_s'\]|peak"),
    (_placer(time_of=_wall_clock), "never run through `timer`"),
    (_placer(thresholds=False), "on_roof=0.3"),
    (_placer(fraction_of=lambda op, t, peak, bw: op.flops / t / peak), r"\['fraction'\]"),
], ids=["roofline-says-so", "mean", "min", "last-sample", "first-sample", "middle-sample",
        "own-clock", "fixed-thresholds", "fraction-of-peak"])
def test_placement_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    _fails(check.place_on_roofline, cheat, why)


def test_a_placement_without_measuring_fails() -> None:
    def predicted(ops, roof, slope, timer, on_roof=0.5, in_cache=1.5):  # noqa: ANN001, ANN202
        peak, bandwidth = 100e9, 20e9  # a datasheet's numbers, no measurement
        out = {}
        for op in ops:
            t = max(op.flops / peak, op.nbytes / bandwidth)
            bound = "compute" if op.flops / peak >= op.nbytes / bandwidth else "memory"
            out[op.name] = {"time_s": t, "intensity": op.flops / op.nbytes,
                            "achieved_flops": op.flops / t, "fraction": 1.0, "roofline": bound,
                            "measured": bound}
        return {"peak_flops": peak, "bandwidth_Bps": bandwidth, "ops": out}

    _fails(check.place_on_roofline, predicted, "never run through `timer`")


def test_a_placement_by_labsims_roofline_fails() -> None:
    import labsim

    def library(ops, roof, slope, timer, on_roof=0.5, in_cache=1.5):  # noqa: ANN001, ANN202
        place = _placer()(ops, roof, slope, timer, on_roof, in_cache)
        line = labsim.Roofline("here", place["peak_flops"], place["bandwidth_Bps"])
        for op in ops:
            place["ops"][op.name]["roofline"] = line.bound(op.flops, op.nbytes)
        return place

    _fails(check.place_on_roofline, library, REFERENCE)


def test_the_virtual_timer_gives_the_scheduled_median_and_a_slow_sample() -> None:
    device = check.VirtualDevice()
    run = device.job("op", 0.01)
    run()  # the slow first call, outside the timer
    samples = device.timer(run)
    device.close()
    assert statistics.median(samples) == pytest.approx(0.01, rel=1e-12)
    assert max(samples) == pytest.approx(0.04) and min(samples) == pytest.approx(0.0097)
    assert device.timed == {"op": 1 + len(samples)}


# -- a training step's FLOPs, counted --------------------------------------------------------

def _counter(split):  # noqa: ANN001, ANN202
    """A learner's ``count_step`` that counts the whole step once and splits it as
    ``split(total, forward_alone)`` says."""

    def count_step(loss_fn, n_params, tokens):  # noqa: ANN001, ANN202
        with FlopCounterMode(display=False) as counter:
            loss_fn()
        forward = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            loss_fn().backward()
        fwd, bwd = split(counter.get_total_flops(), forward)
        return {"forward": fwd, "backward": bwd, "backward_per_forward": bwd / fwd,
                "flops_per_param_token": (fwd + bwd) / (n_params * tokens)}

    return count_step


def _own_dispatch_count(loss_fn, n_params, tokens):  # noqa: ANN001, ANN202
    """Honest: the FLOPs of every matrix product, counted with a dispatch mode of one's own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class Count(TorchDispatchMode):
        flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (aten.mm, aten.bmm):
                self.flops += 2 * math.prod(out.shape) * args[0].shape[-1]
            elif func.overloadpacket in (aten.addmm, aten.baddbmm):
                self.flops += 2 * math.prod(out.shape) * args[1].shape[-1]
            return out

    with Count() as forward:
        loss = loss_fn()
    with Count() as backward:
        loss.backward()
    f, b = forward.flops, backward.flops
    return {"forward": f, "backward": b, "backward_per_forward": b / f,
            "flops_per_param_token": (f + b) / (n_params * tokens)}


@pytest.mark.slow
def test_an_own_dispatch_count_passes(capsys: pytest.CaptureFixture) -> None:
    _passes(check.count_step, _own_dispatch_count, capsys)


def _six_n(loss_fn, n_params, tokens):  # noqa: ANN001, ANN202
    total = 6 * n_params * tokens
    return {"forward": total / 3, "backward": 2 * total / 3, "backward_per_forward": 2.0,
            "flops_per_param_token": 6.0}


@pytest.mark.slow
@pytest.mark.parametrize(("cheat", "why"), [
    (_counter(lambda total, fwd: (fwd, 2 * fwd)), r"recompute.*\['backward'\]|frozen|MLP"),
    (_counter(lambda total, fwd: (total / 3, 2 * total / 3)), r"\['forward'\]"),
    (_counter(lambda total, fwd: (fwd, total)), r"\['backward'\]"),
    (_six_n, r"\['forward'\]"),
], ids=["backward-is-twice-forward", "step-split-in-thirds", "backward-with-forward", "6N"])
def test_count_step_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    _fails(check.count_step, cheat, why)


@pytest.mark.slow
def test_count_step_from_the_closed_form_fails() -> None:
    def closed_form(loss_fn, n_params, tokens):  # noqa: ANN001, ANN202
        model = loss_fn.__defaults__[0]
        flops = model.cfg.flops_per_token * tokens
        return {"forward": flops / 3, "backward": 2 * flops / 3, "backward_per_forward": 2.0,
                "flops_per_param_token": flops / (n_params * tokens)}

    _fails(check.count_step, closed_form, REFERENCE)


@pytest.mark.slow
def test_the_graders_count_is_flop_counter_modes() -> None:
    for config in check.STEP_MODELS:
        _, loss_fn, _, _, _ = check._model(config)
        with FlopCounterMode(display=False) as forward:
            loss = loss_fn()
        with FlopCounterMode(display=False) as backward:
            loss.backward()
        assert check.counted_flops(config) == (forward.get_total_flops(),
                                               backward.get_total_flops()), config
        if config["kind"] == "gpt":
            assert 3 * forward.get_total_flops() == check.model_flops(config)


@pytest.mark.slow
def test_the_cases_hold_the_traps() -> None:
    """Backward/forward is 2, below 2 (an input or a layer needing no gradient) and above 2
    (recomputation) among the cases, so no single ratio passes."""
    ratios = {round(c.expected["backward_per_forward"], 3) for c in check.count_step.cases()}
    assert 2.0 in ratios and min(ratios) < 2 < max(ratios)


# -- MFU and HFU of a measured step ----------------------------------------------------------

def _utilisation(model_of=None, time_of=None, check_peak=True):  # noqa: ANN001, ANN202
    """A learner's ``utilisation`` with model and hardware FLOPs from the two counts as
    ``model_of(forward, step) -> (model, hardware)`` says and the step time as
    ``time_of(step, timer)`` says."""

    def utilisation(loss_fn, step, timer, peak_flops):  # noqa: ANN001, ANN202
        if check_peak and peak_flops <= 0:
            raise ValueError("peak must be > 0")
        with FlopCounterMode(display=False) as counter:
            loss_fn()
        forward = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            step()
        whole = counter.get_total_flops()
        model, hardware = (model_of or (lambda f, s: (3 * f, s)))(forward, whole)
        t = (time_of or (lambda step, timer: statistics.median(timer(step))))(step, timer)
        return {"step_s": t, "mfu": model / t / peak_flops, "hfu": hardware / t / peak_flops}

    return utilisation


def _wall_step(step, timer):  # noqa: ANN001, ANN202
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


@pytest.mark.slow
def test_utilisation_with_an_own_median_passes(capsys: pytest.CaptureFixture) -> None:
    _passes(check.utilisation,
            _utilisation(time_of=lambda step, timer: sorted(timer(step))[2]), capsys)


@pytest.mark.slow
@pytest.mark.parametrize(("cheat", "why"), [
    (_utilisation(model_of=lambda f, s: (3 * f, 3 * f)), r"full recompute.*\['hfu'\]"),
    (_utilisation(model_of=lambda f, s: (s, s)), r"full recompute.*\['mfu'\]"),
    (_utilisation(model_of=lambda f, s: (2 * f, s)), r"\['mfu'\]"),
    (_utilisation(model_of=lambda f, s: (3 * f, 4 * f)), r"\['hfu'\]"),
    (_utilisation(time_of=lambda step, timer: statistics.mean(timer(step))), r"\['step_s'\]"),
    (_utilisation(time_of=lambda step, timer: min(timer(step))), r"\['step_s'\]"),
    (_utilisation(time_of=_wall_step), r"\['step_s'\]"),
    (_utilisation(check_peak=False), "ValueError"),
], ids=["hfu-is-mfu", "mfu-from-the-step", "forward-twice", "one-more-forward", "mean-time",
        "min-time", "wall-clock", "no-peak-check"])
def test_utilisation_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    _fails(check.utilisation, cheat, why)


@pytest.mark.slow
def test_utilisation_from_labsims_closed_form_or_a_table_fails() -> None:
    def closed_form(loss_fn, step, timer, peak_flops):  # noqa: ANN001, ANN202
        model, idx = loss_fn.__defaults__[:2]
        flops = model.cfg.flops_per_token * idx.numel()
        t = statistics.median(timer(step))
        return {"step_s": t, "mfu": flops / t / peak_flops, "hfu": flops / t / peak_flops}

    _fails(check.utilisation, closed_form, REFERENCE)
    _fails(check.utilisation, lambda loss_fn, step, timer, peak: {
        "step_s": 0.01, "mfu": 0.168, "hfu": 0.168}, "FAIL utilisation: 0/6")
