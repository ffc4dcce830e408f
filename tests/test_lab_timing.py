"""Comparisons that say "too noisy to tell" rather than a verdict the next run may reverse."""

import time

import pytest
import torch

from labsim.lab.device import Timing
from labsim.lab.timing import compare, one_thread, time_interleaved


def _t(*ms):
    return Timing(tuple(m / 1e3 for m in ms))


def test_a_clear_difference_is_a_verdict_with_its_spread():
    c = compare({"bf16": _t(1, 1.1, 0.9, 1, 1), "fp32": _t(2, 2.1, 2, 1.9, 2)}, "fp32", "bf16")
    assert (c.fast, c.slow) == ("bf16", "fp32")
    assert c.settled and not c.same_speed
    assert 1.9 < c.ratio < 2.2
    assert c.verdict.startswith("bf16 is 2.00x faster than fp32")


def test_rounds_that_disagree_are_too_noisy_to_tell():
    # a load that came and went: round by round the winner changes
    c = compare({"a": _t(1, 3, 1, 3, 1, 3), "b": _t(2, 1, 2, 1, 2, 1)}, "a", "b")
    assert not c.settled
    assert c.verdict.startswith("too noisy to tell")


def test_equal_times_are_the_same_speed_not_a_winner():
    c = compare({"a": _t(1, 1.02, 0.99, 1), "b": _t(1.01, 1, 1, 1.02)}, "a", "b")
    assert c.settled and c.same_speed
    assert "same time within 10 %" in c.verdict


def test_a_uniform_slowdown_of_one_round_does_not_change_the_verdict():
    # interleaving pairs rounds: a loaded round slows both contenders
    c = compare({"a": _t(1, 10, 1, 1, 1), "b": _t(3, 30, 3, 3, 3)}, "a", "b")
    assert c.settled and c.fast == "a" and c.ratio == pytest.approx(3)


def test_time_interleaved_rotates_and_times_every_round():
    order = []
    fns = {n: (lambda n=n: order.append(n)) for n in "abc"}
    out = time_interleaved(fns, warmup=0, rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(t.times_s) == 3 for t in out.values())


def test_time_interleaved_stops_after_max_seconds():
    out = time_interleaved({"sleep": lambda: time.sleep(0.02)}, warmup=0, rounds=100,
                           max_seconds=0.05)
    assert 1 <= len(out["sleep"].times_s) < 10


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="at least one"):
        time_interleaved({})
    with pytest.raises(ValueError, match="threshold"):
        compare({"a": _t(1), "b": _t(1)}, "a", "b", threshold=1)


def test_one_thread_restores_the_setting():
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
