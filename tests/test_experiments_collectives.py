"""Lab 07's timing helpers: every call's seconds on request, and a held-out verdict that reads
the model's error against the timing's own spread."""

from __future__ import annotations

import pytest

from labsim.experiments.collectives import held_out_verdict, timing_worker, torch_allreduce
from labsim.lab import launch


def test_a_prediction_inside_the_middle_half_is_said_to_be_so() -> None:
    seconds = [1.0e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3]
    text = held_out_verdict(1.15e-3, seconds)
    assert "within the middle half" in text and "-4% from the median" in text


def test_a_prediction_outside_is_given_its_error() -> None:
    text = held_out_verdict(2.4e-3, [1.0e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3])
    assert "+100% from the median, outside" in text


def test_repeats_that_disagree_are_too_noisy_to_judge_any_prediction() -> None:
    noisy = [1e-3, 1.1e-3, 1.2e-3, 5e-3, 9e-3, 11e-3, 12e-3]
    for predicted in (1.2e-3, 5e-3, 50e-3):
        assert "too noisy to tell" in held_out_verdict(predicted, noisy)
    with pytest.raises(ValueError, match="repeat >= 1"):
        held_out_verdict(1e-3, [])


@pytest.mark.multiprocess
def test_the_worker_returns_every_call_sorted_when_asked() -> None:
    out = launch(timing_worker, 2, args=({"gloo": torch_allreduce}, [16, 256]),
                 kwargs={"repeat": 4, "samples": True}, timeout_s=120)[0]["gloo"]
    assert [len(calls) for calls in out] == [4, 4]
    assert all(calls == sorted(calls) and calls[0] > 0 for calls in out)
    medians = launch(timing_worker, 2, args=({"gloo": torch_allreduce}, [16]),
                     kwargs={"repeat": 3}, timeout_s=120)[0]["gloo"]
    assert len(medians) == 1 and isinstance(medians[0], float)
