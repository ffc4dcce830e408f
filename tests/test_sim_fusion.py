"""labsim.sim.fusion: the simulated host/device queue agrees with fusion.chain_time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim import fusion
from labsim.fusion import Op
from labsim.sim.fusion import simulate_chain

CHAIN = fusion.BIAS_GELU_DROPOUT_RESIDUAL
SIZES = {"x": 4, "bias": 0, "keep": 1, "residual": 4, "t1": 4, "t2": 4, "t3": 4, "t4": 4, "y": 4}


@settings(max_examples=50, deadline=None)
@given(numel=st.integers(1, 10**7), launch=st.floats(0, 1e-4), fused=st.booleans(),
       async_launch=st.booleans())
def test_simulation_equals_closed_form(numel: int, launch: float, fused: bool,
                                       async_launch: bool) -> None:
    kw = dict(fused=fused, launch_s=launch, bandwidth_Bps=2e12, async_launch=async_launch)
    closed = fusion.chain_time(CHAIN, numel, SIZES, **kw)
    run = simulate_chain(CHAIN, numel, SIZES, **kw)
    assert run.time_s == pytest.approx(closed.time_s, rel=1e-9, abs=1e-15)
    assert run.launches == closed.launches
    assert run.device_busy_s == pytest.approx(closed.traffic_s, rel=1e-9, abs=1e-15)


def test_trace_alternates_when_the_host_waits() -> None:
    ops = tuple(Op(f"op{i}", ("a",), "b") for i in range(3))
    run = simulate_chain(ops, 1, {"a": 1.0, "b": 1.0}, fused=False, launch_s=1.0,
                         bandwidth_Bps=1.0)
    spans = sorted(run.trace, key=lambda s: s.start_s)
    assert [(s.stream, s.start_s, s.end_s) for s in spans] == [
        ("host", 0, 1), ("device", 1, 3), ("host", 3, 4), ("device", 4, 6),
        ("host", 6, 7), ("device", 7, 9)]
    assert run.device_idle_fraction == pytest.approx(3 / 9)


def test_async_host_runs_ahead_and_the_device_never_idles_after_the_first_launch() -> None:
    ops = tuple(Op(f"op{i}", ("a",), "b") for i in range(4))
    run = simulate_chain(ops, 1, {"a": 1.0, "b": 1.0}, fused=False, launch_s=0.5,
                         bandwidth_Bps=1.0, async_launch=True)
    assert run.time_s == pytest.approx(0.5 + 4 * 2.0)
    host = [s for s in run.trace if s.stream == "host"]
    assert max(s.end_s for s in host) == pytest.approx(2.0)


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError):
        simulate_chain(CHAIN, 1, SIZES, fused=True, launch_s=-1, bandwidth_Bps=1)
    with pytest.raises(ValueError):
        simulate_chain((), 1, {}, fused=True, launch_s=0, bandwidth_Bps=1)
