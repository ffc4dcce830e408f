"""Simulated decode step = closed form (layers x max) plus the one phase overlap cannot hide."""

from __future__ import annotations

import pytest

from labsim.quantization import decode_cost, decode_step_time
from labsim.sim import simulate_decode_step


def phases(batch: int, context: int, weights: str = "fp16") -> tuple[float, float]:
    c = decode_cost("H100-SXM", batch=batch, context=context, weights=weights)
    return batch * c.nbytes / c.roof.bandwidth_Bps, batch * c.flops / c.roof.peak_flops


@pytest.mark.parametrize("weights", ["fp16", "int8"])
def test_memory_bound_step_is_all_loads_plus_the_last_compute(weights: str) -> None:
    load, comp = phases(1, 1024, weights)
    assert load > comp
    r = simulate_decode_step("H100-SXM", batch=1, context=1024, weights=weights, layers=8)
    assert r.time_s == pytest.approx(8 * load + comp, rel=1e-12)
    closed = decode_step_time("H100-SXM", batch=1, context=1024, weights=weights, layers=8)
    assert closed == pytest.approx(8 * load, rel=1e-12)


def test_compute_bound_step_is_the_first_load_plus_all_computes() -> None:
    load, comp = phases(4096, 0)
    assert comp > load
    r = simulate_decode_step("H100-SXM", batch=4096, context=0, layers=5)
    assert r.time_s == pytest.approx(load + 5 * comp, rel=1e-12)


def test_no_prefetch_means_no_overlap() -> None:
    load, comp = phases(16, 512)
    r = simulate_decode_step("H100-SXM", batch=16, context=512, layers=4, prefetch=0)
    assert r.time_s == pytest.approx(4 * (load + comp), rel=1e-12)


def test_closed_form_and_simulation_agree_for_many_layers() -> None:
    for batch in (1, 64, 4096):
        sim = simulate_decode_step("A100-80GB", batch=batch, context=256, layers=2000)
        closed = decode_step_time("A100-80GB", batch=batch, context=256, layers=2000)
        assert sim.time_s / closed == pytest.approx(1.0, abs=1e-3)
        assert sim.per_token_s == pytest.approx(sim.time_s / batch)


def test_trace_orders_loads_before_computes() -> None:
    r = simulate_decode_step("H100-SXM", batch=2, context=128, layers=6, prefetch=1)
    loads = r.trace.filter(stream="hbm").spans
    comps = r.trace.filter(stream="sm").spans
    assert len(loads) == len(comps) == 6
    for load, comp in zip(loads, comps):
        assert comp.start_s >= load.end_s
    for a, b in zip(comps, comps[1:]):
        assert b.start_s >= a.end_s
    for i in range(2, 6):  # with one layer of prefetch, load i waits for compute i-2
        assert loads[i].start_s >= comps[i - 2].end_s
    assert r.trace.makespan_s == pytest.approx(r.time_s)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        simulate_decode_step("H100-SXM", prefetch=-1)
    with pytest.raises(ValueError, match="layers"):
        simulate_decode_step("H100-SXM", layers=0)
    with pytest.raises(ValueError, match="layers"):
        decode_step_time("H100-SXM", layers=0)
