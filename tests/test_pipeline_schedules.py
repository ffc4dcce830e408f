"""Schedules written op by op (labsim.pipeline): the rules a schedule must keep, its exact
timeline on paper (equal to the simpy engine for the named schedules), and the zero-bubble
schedule ZB-H1 against its closed form."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.pipeline import (
    Op,
    bubble_fraction,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    pipeline_time,
    schedule_problems,
    timeline,
    zero_bubble_h1,
)
from labsim.sim.pipeline import simulate_pipeline

NAMED = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1), ("1f1b", 1, 3, 1),
         ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3), ("interleaved", 4, 4, 2)]


@pytest.mark.parametrize("name, p, m, v", NAMED)
@pytest.mark.parametrize("p2p_s", [0.0, 0.3])
def test_timeline_equals_the_simulated_engine(name: str, p: int, m: int, v: int,
                                              p2p_s: float) -> None:
    on_paper = timeline(make_schedule(name, p, m, v), 1.0, 2.0, p2p_s=p2p_s)
    sim = simulate_pipeline(p, m, 1.0, 2.0, schedule=name, v=v, p2p_s=p2p_s)
    assert on_paper.step_time_s == pytest.approx(sim.step_time_s)
    assert on_paper.bubble_fraction == pytest.approx(sim.bubble_fraction)
    assert on_paper.in_flight == sim.in_flight
    if p2p_s == 0:
        assert on_paper.step_time_s == pytest.approx(pipeline_time(p, m, 1.0, 2.0, v))
        assert on_paper.bubble_fraction == pytest.approx(bubble_fraction(p, m, v))


def test_interleaving_sends_v_times_the_messages() -> None:
    one = timeline(make_schedule("1f1b", 4, 8), 1.0, 2.0).messages
    two = timeline(make_schedule("interleaved", 4, 8, 2), 1.0, 2.0).messages
    assert one == 2 * 8 * (4 - 1) and two == 2 * 8 * (4 * 2 - 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.floats(0.05, 0.95))
def test_zero_bubble_h1_meets_its_closed_form_with_1f1b_memory(p: int, m: int,
                                                              w_share: float) -> None:
    schedule = zero_bubble_h1(p, m)
    assert schedule_problems(schedule, p, m) == []
    t_f, t_b = 1.0, 2.0
    t_w = w_share * t_b * 0.5  # W no longer than B, as in Qi et al.'s uniform case
    tl = timeline(schedule, t_f, t_b, t_w=t_w)
    if m >= p:
        assert tl.step_time_s == pytest.approx(m * (t_f + t_b) + (p - 1) * (t_f + t_b - 2 * t_w))
    assert tl.step_time_s <= timeline(one_f_one_b(p, m), t_f, t_b).step_time_s + 1e-9
    assert max(tl.in_flight) == min(p, m)


def test_in_flight_counts_activations_until_the_weight_gradient() -> None:
    assert max_in_flight((Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1))) == 2
    assert max_in_flight((Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1), Op("W", 0),
                          Op("W", 1))) == 2


def test_problems_name_what_is_wrong() -> None:
    ok = make_schedule("1f1b", 2, 3)
    assert schedule_problems(ok, 2, 3) == []
    assert "2 stage lists" in schedule_problems(ok, 3, 3)[0]
    missing = (ok[0][:-1], ok[1])
    assert "lacks a backward" in schedule_problems(missing, 2, 3)[0]
    twice = (ok[0] + (Op("F", 0),), ok[1])
    assert "runs twice" in schedule_problems(twice, 2, 3)[0]
    backwards = (ok[0], (Op("B", 0), Op("F", 0)) + ok[1][2:])
    assert "backward before its forward" in schedule_problems(backwards, 2, 3)[0]
    # locally ordered, globally impossible: stage 0 waits for B0 before it sends F1, which
    # stage 1 needs before its F0 and so before its B0
    stuck = ((Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1)),
             (Op("F", 1), Op("F", 0), Op("B", 0), Op("B", 1)))
    assert "deadlock: stage 0 waits at B0" in schedule_problems(stuck, 2, 2)[0]
    with pytest.raises(ValueError, match="deadlock"):
        timeline(stuck, 1.0, 2.0)
    assert "not an op" in schedule_problems(((Op("X", 0),), ()), 2, 1)[0]


def test_fewest_micro_batches_for_a_bubble_target() -> None:
    from labsim.pipeline import bubble_from_trace, min_microbatches

    for p, v in ((2, 1), (4, 1), (8, 1), (8, 2), (16, 4)):
        m = min_microbatches(p, 0.10, v)
        assert bubble_fraction(p, m, v) <= 0.10 < (bubble_fraction(p, m - 1, v) if m > 1 else 1)
    assert min_microbatches(8, 0.10) == 9 * 7
    assert min_microbatches(1, 0.5) == 1
    with pytest.raises(ValueError, match="target"):
        min_microbatches(4, 1.0)
    tl = timeline(one_f_one_b(4, 8), 1.0, 2.0)
    assert bubble_from_trace(tl.trace) == pytest.approx(tl.bubble_fraction)
