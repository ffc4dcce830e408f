"""labsim.fusion: launch-overhead and memory-traffic terms of element-wise chains."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim import fusion
from labsim.fusion import Op

CHAIN = fusion.BIAS_GELU_DROPOUT_RESIDUAL
SIZES = {"x": 4, "bias": 0, "keep": 1, "residual": 4, "t1": 4, "t2": 4, "t3": 4, "t4": 4, "y": 4}


def two_queue_end_time(executions: list[float], launch_s: float) -> float:
    """Event-by-event: the host issues kernel k at (k+1)*launch_s; the GPU runs kernels in
    order, each starting when it is issued and the previous one has finished."""
    gpu_free = 0.0
    for k, run in enumerate(executions):
        start = max((k + 1) * launch_s, gpu_free)
        gpu_free = start + run
    return gpu_free


def test_bias_gelu_dropout_residual_bytes() -> None:
    assert fusion.chain_bytes(CHAIN, 1, SIZES, fused=False) == 8 + 8 + 9 + 8 + 12
    assert fusion.chain_bytes(CHAIN, 1, SIZES, fused=True) == 4 + 1 + 4 + 4
    assert fusion.chain_bytes(CHAIN, 1000, SIZES, fused=True) == 13_000
    assert fusion.chain_launches(CHAIN, fused=False) == 5
    assert fusion.chain_launches(CHAIN, fused=True) == 1


def test_one_op_is_the_same_fused_or_not() -> None:
    add = (Op("add", ("a", "b"), "c"),)
    sizes = {"a": 2, "b": 2, "c": 2}
    assert fusion.chain_bytes(add, 10, sizes, fused=True) == fusion.chain_bytes(
        add, 10, sizes, fused=False) == 60


def test_serial_launches_add_up() -> None:
    cost = fusion.chain_time(CHAIN, 10**6, SIZES, fused=False, launch_s=5e-6, bandwidth_Bps=1e10)
    assert cost.time_s == pytest.approx(5 * 5e-6 + 45e6 / 1e10)
    assert cost.launches == 5 and not cost.launch_bound
    fused = fusion.chain_time(CHAIN, 10**6, SIZES, fused=True, launch_s=5e-6, bandwidth_Bps=1e10)
    assert fused.time_s == pytest.approx(5e-6 + 13e6 / 1e10)


def test_compute_roof_applies_per_kernel() -> None:
    cost = fusion.chain_time(CHAIN, 100, SIZES, fused=True, launch_s=0.0, bandwidth_Bps=1e30,
                              peak_flops=1.0)
    assert cost.time_s == pytest.approx(fusion.chain_flops(CHAIN, 100))


@pytest.mark.parametrize(("execution", "launch", "expected"), [
    (1.0, 0.25, 0.25 + 5 * 1.0),     # long kernels: only the first launch shows
    (0.25, 1.0, 5 * 1.0 + 0.25),     # short kernels: launch-bound
])
def test_async_launch_limits(execution: float, launch: float, expected: float) -> None:
    ops = tuple(Op(f"op{i}", ("in",), "out") for i in range(5))
    # bytes per element chosen so that each kernel runs exactly `execution` seconds
    cost = fusion.chain_time(ops, 1, {"in": execution / 2, "out": execution / 2}, fused=False,
                              launch_s=launch, bandwidth_Bps=1.0, async_launch=True)
    assert cost.time_s == pytest.approx(expected)


@settings(max_examples=60, deadline=None)
@given(widths=st.lists(st.integers(1, 50), min_size=1, max_size=8),
       launch=st.floats(0, 20), fused=st.booleans())
def test_async_closed_form_equals_the_two_queue_walk(widths: list[int], launch: float,
                                                     fused: bool) -> None:
    ops = tuple(Op(f"op{i}", (f"t{i}",), f"t{i + 1}") for i in range(len(widths)))
    sizes = {f"t{i}": float(w) for i, w in enumerate(widths)} | {f"t{len(widths)}": 1.0}
    cost = fusion.chain_time(ops, 1, sizes, fused=fused, launch_s=launch, bandwidth_Bps=1.0,
                              async_launch=True)
    groups = [list(ops)] if fused else [[op] for op in ops]
    runs = [fusion.chain_bytes(g, 1, sizes, fused=True) for g in groups]
    assert cost.time_s == pytest.approx(two_queue_end_time(runs, launch))
    serial = fusion.chain_time(ops, 1, sizes, fused=fused, launch_s=launch, bandwidth_Bps=1.0)
    assert cost.time_s <= serial.time_s + 1e-9
    assert cost.time_s >= max(sum(runs), len(runs) * launch) - 1e-9


def test_fit_recovers_a_line() -> None:
    sizes = [0.0, 1e6, 5e6, 2e7]
    times = [7e-6 + s / 3e10 for s in sizes]
    launch, bw = fusion.fit_launch_model(sizes, times)
    assert launch == pytest.approx(7e-6) and bw == pytest.approx(3e10)


@pytest.mark.parametrize(("sizes", "times"), [
    ([1.0, 1.0], [1.0, 2.0]), ([1.0, 2.0], [1.0]), ([1.0, 2.0], [2.0, 1.0]),
])
def test_fit_rejects_what_it_cannot_fit(sizes: list, times: list) -> None:
    with pytest.raises(ValueError):
        fusion.fit_launch_model(sizes, times)


@pytest.mark.parametrize("call", [
    lambda: fusion.chain_bytes(CHAIN, 10, {"x": 4}, fused=True),
    lambda: fusion.chain_bytes((), 10, {}, fused=True),
    lambda: fusion.chain_bytes(CHAIN, -1, SIZES, fused=True),
    lambda: fusion.chain_time(CHAIN, 1, SIZES, fused=True, launch_s=-1, bandwidth_Bps=1),
    lambda: fusion.chain_time(CHAIN, 1, SIZES, fused=True, launch_s=0, bandwidth_Bps=0),
    lambda: Op("nothing", (), "y"),
])
def test_bad_input_raises_value_error(call) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        call()
