"""Pipelines timed on real processes (labsim.experiments.pipeline): the learner-shaped
executor and torch.distributed.pipelining's schedules run the orders they are given, equal one
process, and are never faster than their critical path; torch's zero-bubble schedule with one
stage per rank is labsim's ZB-H1."""

from __future__ import annotations

import pytest

from labsim.experiments.pipeline import bubble_worker, collect
from labsim.lab import launch
from labsim.pipeline import gpipe, one_f_one_b, pipeline_time, zero_bubble_h1

from .test_checks_pipeline import pipeline_step

pytestmark = pytest.mark.multiprocess


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
