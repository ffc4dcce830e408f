"""The plan search: every candidate is counted (fits or dropped with a reason), the ranking is
by step time, the best are confirmed by simulation, and any executor gives the same answer."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

import labsim
from labsim.sim.plan import candidate_plans, plan_search

GPT2 = labsim.Transformer.preset("gpt2-124m")
SPACE = dict(micro_batches=(1, 4), recompute=("none",), zero_stages=(0, 1))


def test_every_candidate_is_ranked_or_dropped_with_a_reason() -> None:
    result = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=1, confirm=3, **SPACE)
    n = len(list(candidate_plans(GPT2, labsim.dgx_a100(1), 32, **SPACE)))
    assert result.considered == n == len(result.ranked) + sum(result.dropped.values())
    times = [r.step_time_s for r in result.ranked[3:]]
    assert times == sorted(times)
    assert all(r.simulated is not None for r in result.ranked[:3])
    assert all(r.simulated is None for r in result.ranked[3:])
    best = result.best.plan
    assert best.gpus == 8 and best.global_batch == 32
    assert result.best.estimate.memory.total <= labsim.gpu("A100-80GB").memory_bytes


@pytest.mark.slow
def test_a_thread_pool_and_a_process_pool_agree() -> None:
    local = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=2, confirm=0, **SPACE)
    with cf.ThreadPoolExecutor(2) as pool:
        other = plan_search(GPT2, labsim.dgx_a100(1), 32, executor=pool, confirm=0, **SPACE)
    assert [r.row() for r in local.ranked] == [r.row() for r in other.ranked]


@pytest.mark.slow
def test_nothing_fits_says_why() -> None:
    big = labsim.Transformer.preset("gpt3-175b")
    result = plan_search(big, labsim.dgx_a100(1), 8, workers=1, confirm=0,
                         micro_batches=(1,), recompute=("full",), zero_stages=(0,))
    assert not result.ranked and result.dropped.get("does not fit in memory", 0) > 0
    with pytest.raises(ValueError, match="no plan fits"):
        _ = result.best


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_bad_global_batch(bad: object) -> None:
    with pytest.raises(ValueError, match="global_batch"):
        plan_search(GPT2, labsim.dgx_a100(1), bad)
