"""Pipelines timed on real processes (labsim.experiments.pipeline): the learner-shaped
executor and torch.distributed.pipelining's schedules run the orders they are given, equal one
process, and are never faster than their critical path; torch's zero-bubble schedule with one
stage per rank is labsim's ZB-H1.  Runs repeated in rounds are read as the median round with
the spread, and compared round by round."""

from __future__ import annotations

import pytest

from labsim.experiments.pipeline import (
    RankRun,
    bubble_worker,
    collect,
    excess_verdict,
    step_timings,
    step_verdict,
)
from labsim.lab import launch
from labsim.parallel.pipeline import OpTime
from labsim.pipeline import gpipe, one_f_one_b, pipeline_time, zero_bubble_h1

from .test_checks_pipeline import pipeline_step


@pytest.mark.multiprocess
def test_every_schedule_equals_one_process_in_its_own_order() -> None:
    p, m, t_f, t_b, t_w = 4, 4, 0.004, 0.008, 0.003
    ranks = launch(bubble_worker, p, args=(pipeline_step, {"GPipe": gpipe(p, m),
                                                           "1F1B": one_f_one_b(p, m)},
                                           t_f, t_b, t_w, m), timeout_s=240)
    runs = {r.name: r for r in collect(ranks.values, t_f, t_b, t_w, m)}
    assert len(runs) == 6 and all(r.max_grad_error < 1e-12 for r in runs.values())
    for name, schedule in (("GPipe", gpipe(p, m)), ("1F1B", one_f_one_b(p, m)),
                           ("torch Schedule1F1B", one_f_one_b(p, m))):
        assert [[(o.kind, o.microbatch) for o in ops] for ops in runs[name].ops] == [
            [(o.kind, o.microbatch) for o in ops] for ops in schedule], name
        assert runs[name].step_s >= pipeline_time(p, m, t_f, t_b) * 0.999
    zb = runs["torch ScheduleInterleavedZeroBubble (ZB-H1)"]
    assert [[("B" if o.kind == "I" else o.kind, o.microbatch) for o in ops]
            for ops in zb.ops] == [[(o.kind, o.microbatch) for o in ops]
                                   for ops in zero_bubble_h1(p, m)]
    assert {o.chunk for o in runs["torch ScheduleInterleaved1F1B, v=2"].ops[0]} == {0, 4}
    assert 0 < runs["1F1B"].predicted_bubble == pytest.approx(3 / 7)
    assert len(runs["1F1B"].trace) == 2 * m * p


@pytest.mark.multiprocess
def test_rounds_take_turns_and_each_round_is_kept() -> None:
    p, m, t_f, t_b, t_w = 2, 2, 0.004, 0.008, 0.003
    ranks = launch(bubble_worker, p, args=(pipeline_step, {"1F1B": one_f_one_b(p, m)},
                                           t_f, t_b, t_w, m), kwargs={"rounds": 2},
                   timeout_s=240)
    names = [r.name for r in ranks.values[0]]
    assert len(names) == 2 * 5 and names[0] == "1F1B" and names[5] != "1F1B"
    assert [r.round_index for r in ranks.values[0]] == [0] * 5 + [1] * 5
    runs = collect(ranks.values, t_f, t_b, t_w, m)
    assert [r.name for r in runs] == names[:5]
    assert all(len(r.steps_s) == len(r.bubbles) == 2 for r in runs)


def _ranks(busy_s: dict[str, list[float]], step_s: float = 1.0) -> list[list[RankRun]]:
    """Two ranks; schedule ``name`` busy ``busy_s[name][r]`` seconds of a ``step_s`` step in
    round r (rank 1 idle for the first 0.1 s)."""
    out: list[list[RankRun]] = [[], []]
    for r in range(3):
        for name, busy in busy_s.items():
            for rank in (0, 1):
                start = 0.1 * rank
                out[rank].append(RankRun(name, (OpTime("F", 0, 0, start, start + busy[r]),
                                                OpTime("B", 0, 0, step_s - 0.01, step_s)),
                                         0.0, r))
    return out


def test_collect_reads_the_median_round_and_the_spread() -> None:
    runs = collect(_ranks({"1F1B": [0.5, 0.6, 0.4], "GPipe": [0.5, 0.5, 0.5]}), 0.3, 0.6,
                   0.2, 4)
    one = runs[0]
    assert one.name == "1F1B" and len(one.bubbles) == 3
    assert one.bubble == pytest.approx(sorted(one.bubbles)[1])
    assert one.predicted_step_s == pytest.approx(pipeline_time(2, 4, 0.3, 0.6))
    median, low, high = one.excess
    assert low <= median <= high and median == pytest.approx(one.bubble - one.predicted_bubble)
    assert step_timings(runs)["GPipe"].times_s == runs[1].steps_s


def test_excess_verdict_names_a_winner_only_when_the_rounds_agree() -> None:
    more = collect(_ranks({"a": [0.4, 0.4, 0.4], "b": [0.6, 0.6, 0.6]}), 0.3, 0.6, 0.2, 4)
    assert excess_verdict(more[0], more[1]).startswith("a exceeds its prediction by 20.0 "
                                                       "points more than b")
    assert "less than a" in excess_verdict(more[1], more[0])
    mixed = collect(_ranks({"a": [0.4, 0.6, 0.5], "b": [0.6, 0.4, 0.5]}), 0.3, 0.6, 0.2, 4)
    assert excess_verdict(mixed[0], mixed[1]).startswith("too noisy to tell")


def test_step_verdict_says_what_the_rounds_and_the_closed_form_say() -> None:
    runs = collect(_ranks({"1F1B": [0.5, 0.5, 0.5], "GPipe": [0.5, 0.5, 0.5],
                           "interleaved, v=2": [0.5, 0.5, 0.5]}), 0.3, 0.6, 0.2, 4)
    same = step_verdict(runs, "1F1B", "GPipe")
    assert "take the same time within 5 %" in same and same.endswith("the same time")
    assert step_verdict(runs, "interleaved, v=2", "1F1B").endswith(
        f"interleaved, v=2 {pipeline_time(2, 4, 0.3, 0.6) / pipeline_time(2, 4, 0.3, 0.6, 2):.2f}"
        "x faster than 1F1B")
