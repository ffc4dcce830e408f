"""The plan search: every candidate is counted (fits or dropped with its precise reason), the
ranking is by step time, the best are confirmed by simulation, and any executor gives the same
answer."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

import labsim
from labsim.plan import Plan
from labsim.sim.plan import REASONS, candidate_plans, plan_search, refusal

GPT2 = labsim.Transformer.preset("gpt2-124m")
SPACE = dict(micro_batches=(1, 4), recompute=("none",), zero_stages=(0, 1),
             tp_comm_overlap=(False,))


def test_plan_search_is_public() -> None:
    assert labsim.plan_search is plan_search
    assert {"plan_search", "PlanSearch", "RankedPlan"} <= set(labsim.__all__)


def test_every_candidate_is_ranked_or_dropped_with_a_reason() -> None:
    result = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=1, confirm=3, **SPACE)
    n = len(list(candidate_plans(GPT2, labsim.dgx_a100(1), 32, **SPACE)))
    assert result.considered == n == len(result.ranked) + sum(result.dropped.values())
    assert set(result.dropped) <= set(REASONS)
    times = [r.step_time_s for r in result.ranked[3:]]
    assert times == sorted(times)
    assert all(r.simulated is not None for r in result.ranked[:3])
    assert all(r.simulated is None for r in result.ranked[3:])
    best = result.best.plan
    assert best.gpus == 8 and best.global_batch == 32
    assert result.best.estimate.memory.total <= labsim.gpu("A100-80GB").memory_bytes
    # the ranking is by estimate_step: the estimate of the best is the closed form's
    assert result.ranked[5].estimate.step_time_s == pytest.approx(
        labsim.estimate_step(GPT2, labsim.dgx_a100(1), result.ranked[5].plan).step_time_s)


def _plan_refuses(spec: dict, model: labsim.Transformer, gpus: int) -> bool:
    try:
        Plan(**spec).validate_for(model, gpus)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("model", [GPT2, labsim.Transformer.preset("llama2-7b")])
def test_refusal_agrees_with_plan_on_every_candidate(model: labsim.Transformer) -> None:
    cluster = labsim.dgx_h100(2)
    seen = set()
    for spec in candidate_plans(model, cluster, 48, recompute=("none",),
                                tp_comm_overlap=(False,), sequence_parallel=(False,)):
        why = refusal(spec, model)
        assert (why is not None) == _plan_refuses(spec, model, 16), spec
        seen.add(why)
    assert len(seen - {None}) >= 3  # several distinct reasons, not one catch-all


def test_the_search_takes_the_embedding_and_the_loss_as_layers() -> None:
    """14 layers: no pipeline of 4 stages without the two options; with them every plan of
    the search carries them, pipelines of 4 (14 + 2 = 16) are ranked, and ``refusal`` agrees
    with ``Plan`` on every candidate."""
    model = labsim.Transformer(layers=14, hidden=1024, heads=16, seq_len=1024, vocab=32000)
    split = dict(account_for_embedding_in_pipeline_split=True,
                 account_for_loss_in_pipeline_split=True)
    cluster = labsim.dgx_a100(1)
    plain = plan_search(model, cluster, 32, workers=1, confirm=1, **SPACE)
    both = plan_search(model, cluster, 32, workers=1, confirm=1, **SPACE, **split)
    assert not any(r.plan.pp == 4 for r in plain.ranked)
    assert any(r.plan.pp == 4 for r in both.ranked)
    assert all(r.plan.account_for_loss_in_pipeline_split for r in both.ranked)
    for spec in candidate_plans(model, cluster, 32, **SPACE, **split):
        assert (refusal(spec, model) is not None) == _plan_refuses(spec, model, 8), spec


def test_each_reason_is_named() -> None:
    gqa = labsim.Transformer(layers=6, hidden=512, heads=8, kv_heads=4, seq_len=128,
                             vocab=1000)
    assert refusal(dict(tp=3), gqa) == "tp does not divide heads"
    assert refusal(dict(tp=8), gqa) is None  # kv heads replicated
    assert refusal(dict(pp=4), gqa) == "pp x virtual stages does not divide layers"
    assert refusal(dict(pp=2, virtual_stages=2, schedule="interleaved"), gqa) == \
        "pp x virtual stages does not divide layers"
    assert refusal(dict(dp=4, micro_batch=3, global_batch=16), gqa) == \
        "dp x micro-batch does not divide the global batch"
    assert refusal(dict(pp=2, virtual_stages=3, global_batch=3), gqa) == \
        "interleaved: micro-batches not a multiple of pp"
    assert refusal(dict(pp=2, zero_stage=2, global_batch=4), gqa) == \
        "ZeRO-2/3 with pipeline parallelism"
    odd = labsim.Transformer(layers=4, hidden=768, heads=12, kv_heads=6, seq_len=128,
                             vocab=1000)
    assert refusal(dict(tp=4), odd) == "tp and kv_heads do not split evenly"


def test_tp_overlap_and_tp_cap_are_searched() -> None:
    generic = list(candidate_plans(GPT2, labsim.dgx_a100(2), 32))
    assert {s["tp_comm_overlap"] for s in generic} == {False}  # the profile hides none
    specs = list(candidate_plans(GPT2, labsim.dgx_a100(2), 32, tp_max=8,
                                 software="megatron-core-te"))
    assert max(s["tp"] for s in specs) == 8
    assert {s["tp_comm_overlap"] for s in specs if s["tp"] > 1} == {False, True}
    assert {s["tp_comm_overlap"] for s in specs if s["tp"] == 1} == {False}
    # across nodes the overlap hides nothing (StepCosts.tp_hidden): not searched unless asked
    wide = list(candidate_plans(GPT2, labsim.dgx_a100(2), 32, software="megatron-core-te"))
    assert {s["tp_comm_overlap"] for s in wide if s["tp"] == 16} == {False}
    asked = list(candidate_plans(GPT2, labsim.dgx_a100(2), 32, tp_comm_overlap=(True,),
                                 software="megatron-core-te"))
    assert {s["tp_comm_overlap"] for s in asked if s["tp"] == 16} == {True}


class _InOrder:
    """An executor whose futures are not concurrent.futures futures (as a distributed
    engine's may be): submit runs at once, result() returns it."""

    class _F:
        def __init__(self, value: object) -> None:
            self.value = value

        def result(self) -> object:
            return self.value

    def submit(self, fn, *args):  # noqa: ANN001, ANN201 - the executor protocol
        return self._F(fn(*args))


def test_a_foreign_executor_gives_the_same_ranking() -> None:
    local = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=1, confirm=0, chunk=7, **SPACE)
    other = plan_search(GPT2, labsim.dgx_a100(1), 32, executor=_InOrder(), confirm=0,
                        chunk=7, **SPACE)
    assert [r.row() for r in local.ranked] == [r.row() for r in other.ranked]
    assert local.dropped == other.dropped


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_thread_pool_and_a_process_pool_agree() -> None:
    local = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=2, confirm=0, chunk=16,
                        **SPACE)
    with cf.ThreadPoolExecutor(2) as pool:
        other = plan_search(GPT2, labsim.dgx_a100(1), 32, executor=pool, confirm=0,
                            chunk=5, **SPACE)
    assert [r.row() for r in local.ranked] == [r.row() for r in other.ranked]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_runs_unchanged_on_a_local_dask_cluster() -> None:
    distributed = pytest.importorskip(
        "dask.distributed", reason="dask[distributed] is not installed here; the executor "
        "hook is tested on a local Dask cluster only where it is")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as lc, \
            distributed.Client(lc) as client:
        remote = plan_search(GPT2, labsim.dgx_a100(1), 32, executor=client.get_executor(),
                             confirm=0, **SPACE)
    local = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=1, confirm=0, **SPACE)
    assert [r.row() for r in remote.ranked] == [r.row() for r in local.ranked]


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


@pytest.mark.parametrize("kwargs, word", [(dict(workers=0), "workers"),
                                          (dict(chunk=0), "chunk"),
                                          (dict(confirm=-1), "confirm"),
                                          (dict(executor=object()), "executor"),
                                          (dict(microbatch_group=8), "one chosen Plan")])
def test_bad_search_settings(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        plan_search(GPT2, labsim.dgx_a100(1), 32, **kwargs)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_multiprocessing_pool_gives_the_same_ranking() -> None:
    """The multiprocessing.Pool API (apply_async / get), which Ray's
    ray.util.multiprocessing.Pool provides as a drop-in replacement."""
    import multiprocessing

    local = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=1, confirm=0, **SPACE)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        other = plan_search(GPT2, labsim.dgx_a100(1), 32, executor=pool, confirm=0, chunk=9,
                            **SPACE)
    assert [r.row() for r in local.ranked] == [r.row() for r in other.ranked]
    assert local.dropped == other.dropped


@pytest.mark.slow
@pytest.mark.multiprocess
def test_runs_unchanged_on_a_local_ray_pool() -> None:
    ray_mp = pytest.importorskip(
        "ray.util.multiprocessing", reason="ray is not installed here; the apply_async hook "
        "is tested with the standard library's multiprocessing.Pool instead")
    with ray_mp.Pool(2) as pool:
        remote = plan_search(GPT2, labsim.dgx_a100(1), 32, executor=pool, confirm=0, **SPACE)
    local = plan_search(GPT2, labsim.dgx_a100(1), 32, workers=1, confirm=0, **SPACE)
    assert [r.row() for r in remote.ranked] == [r.row() for r in local.ranked]
