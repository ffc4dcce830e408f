"""Closed forms of tensor parallelism (labsim.tensor_parallel): Megatron's bytes per layer and
collective matmul, whose simulated face (labsim.sim.tensor_parallel) agrees with it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.sim.tensor_parallel import simulate_collective_matmul
from labsim.tensor_parallel import collective_matmul_s, layer_gemm_flops, tp_comm_elements


def test_megatron_sends_eight_bsh_per_layer_and_nothing_alone() -> None:
    assert tp_comm_elements(1, 2048, 12288, 8) == 8 * 2048 * 12288 * 7 / 8
    assert tp_comm_elements(4, 16, 8, 1) == 0.0
    with pytest.raises(ValueError, match="tp"):
        tp_comm_elements(1, 16, 8, 0)


def test_collective_matmul_hides_short_steps_and_exposes_one_shard_of_long_ones() -> None:
    assert collective_matmul_s(8.0, 1.0, 1) == 8.0  # nothing to gather
    assert collective_matmul_s(8.0, 3.0, 4) == 8.0  # 1 s per step < 2 s per shard: hidden
    assert collective_matmul_s(4.0, 9.0, 4) == 3 * 3.0 + 1.0  # 3 steps, then one shard
    # the 3 shards under the ring run 25 % slower: 3 x 2.5 + 2 s, longer than the ring's 3 s + 2
    assert collective_matmul_s(8.0, 3.0, 4, overlap_slowdown=0.25) == 3 * 2.5 + 2.0
    assert collective_matmul_s(4.0, 9.0, 4, overlap_slowdown=0.25) == 3 * 3.0 + 1.0
    with pytest.raises(ValueError, match="overlap_slowdown"):
        collective_matmul_s(8.0, 3.0, 4, overlap_slowdown=1.5)
    with pytest.raises(ValueError, match="gemm_s"):
        collective_matmul_s(math.nan, 1.0, 2)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.integers(1, 16))
def test_simulated_collective_matmul_equals_the_closed_form(gemm: float, comm: float,
                                                            tp: int) -> None:
    t = simulate_collective_matmul(gemm, comm, tp).time_s
    assert t == pytest.approx(collective_matmul_s(gemm, comm, tp), rel=1e-9, abs=1e-12)
    assert max(gemm, comm if tp > 1 else 0.0) - 1e-9 <= t <= gemm + comm + 1e-9


def test_the_trace_shows_every_shard_after_its_ring_step() -> None:
    run = simulate_collective_matmul(4.0, 9.0, 4)
    gemms = [s for s in run.trace if s.stream == "compute"]
    steps = [s for s in run.trace if s.stream == "comm"]
    assert len(gemms) == 4 and len(steps) == 3
    assert all(g.start_s >= s.end_s for g, s in zip(gemms[1:], steps))


def test_layer_flops_add_up_to_megatrons_per_layer_count() -> None:
    b, s, h = 2, 2048, 4096
    parts = layer_gemm_flops(b, s, h)
    assert sum(parts.values()) == 24 * b * s * h ** 2 * (1 + s / (6 * h))
