"""The mixture-of-experts lab's library: the reference layer (serial, dense and expert-parallel
on real processes), capacity, and the studies (traffic on 4 processes, parameters, EP inside
and across nodes, node-limited routing, the published Mixtral run)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from labsim import Plan, Transformer, dgx_h100
from labsim.experiments import moe
from labsim.lab import launch
from labsim.parallel import expert_parallel as ep


def _layer(tokens: int = 12, hidden: int = 6, ffn: int = 10, experts: int = 8, seed: int = 0
           ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, hidden, generator=g, dtype=torch.float64),
            torch.randn(experts, hidden, generator=g, dtype=torch.float64),
            torch.randn(experts, ffn, hidden, generator=g, dtype=torch.float64),
            torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("k", [1, 2, 8])
def test_the_sparse_layer_equals_the_dense_one(k: int) -> None:
    args = _layer()
    torch.testing.assert_close(ep.moe_forward(*args, k), ep.dense_moe(*args, k))


def test_the_router_renormalises_over_the_chosen_experts() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.float64)
    weights, experts = ep.top_k_route(logits, 2)
    assert experts.tolist() == [[1, 2]]
    probs = torch.softmax(logits, -1)[0, [1, 2]]
    torch.testing.assert_close(weights[0], probs / probs.sum())


def test_the_balancing_loss_is_one_when_uniform_and_grows_when_collapsed() -> None:
    uniform = torch.zeros(8, 4, dtype=torch.float64)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(ep.balancing_loss(uniform, balanced, 4)) == pytest.approx(1.0)
    collapsed = uniform.clone()
    collapsed[:, 0] = 10.0
    assert float(ep.balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), 4)) > 3.9


def test_capacity_keeps_the_largest_weights_up_to_the_ceiling() -> None:
    weights = torch.tensor([[0.9], [0.2], [0.7], [0.4], [0.8]], dtype=torch.float64)
    experts = torch.zeros(5, 1, dtype=torch.long)
    assert ep.capacity(5, 1, 4, 1.0) == 2  # ceil(5 / 4)
    assert ep.capacity_keep(weights, experts, 4, 1.0)[:, 0].tolist() == [True, False, False,
                                                                         False, True]
    assert bool(ep.capacity_keep(weights, experts, 4, 4.0).all())


def test_rank_experts_names_the_fix() -> None:
    assert ep.rank_experts(1, 4, 8) == slice(2, 4)
    with pytest.raises(ValueError, match="divides the experts"):
        ep.rank_experts(0, 3, 8)


@pytest.mark.multiprocess
def test_the_expert_parallel_layer_equals_the_whole_layer_on_4_processes() -> None:
    worst = launch("labsim.parallel.expert_parallel:demo", 4, timeout_s=120).values
    assert max(worst) < 1e-12


@pytest.mark.multiprocess
def test_traffic_counts_every_row_once_and_sees_the_skew() -> None:
    runs = launch(moe.traffic_worker, 4, args=(ep.top_k_route, ep.ep_moe_forward,
                                               ep.capacity_keep, (0.0, 3.0)),
                  kwargs={"tokens": 64, "hidden": 16, "ffn": 32}, timeout_s=120).values
    for i in range(2):
        ranks = [r[i] for r in runs]
        sent = sum(map(sum, (r.sent_rows for r in ranks)))
        assert sent == 4 * 64 * 2 == sum(r.received_rows for r in ranks)
        for r in ranks:  # a count exchange, dispatch and combine forward; two back
            assert [k for k, _ in r.forward] == ["all_to_all"] * 3
            assert [k for k, _ in r.backward] == ["all_to_all"] * 2
    balanced, skewed = ([r[i] for r in runs] for i in range(2))
    assert moe.imbalance(skewed) > 1.5 * moe.imbalance(balanced)
    assert sum(r.dropped[0] for r in skewed) > sum(r.dropped[0] for r in balanced)
    assert all(r.dropped[1] <= r.dropped[0] for r in balanced + skewed)


def test_offnode_copies_match_a_monte_carlo_draw() -> None:
    rng = random.Random(0)
    draws = 20000
    unlimited = sum(len({e // 32 for e in rng.sample(range(256), 8)} - {rng.randrange(8)})
                    for _ in range(draws)) / draws
    assert moe.offnode_copies(256, 8, 8) == pytest.approx(unlimited, rel=0.02)
    limited = 0
    for _ in range(draws):  # 4 nodes by symmetry, then 8 experts among theirs
        nodes = rng.sample(range(8), 4)
        chosen = {nodes[e // 32] for e in rng.sample(range(128), 8)}
        limited += len(chosen - {rng.randrange(8)})
    assert moe.offnode_copies(256, 8, 8, limit=4) == pytest.approx(limited / draws, rel=0.02)
    assert moe.offnode_copies(256, 8, 8, dedup=False) == 7.0
    assert moe.offnode_copies(256, 8, 8, limit=4, dedup=False) == 7.0


@pytest.mark.parametrize("bad", [dict(experts=250), dict(k=0), dict(k=300),
                                 dict(limit=1, k=40)])
def test_offnode_copies_refuses_impossible_layouts(bad: dict) -> None:
    args = {"experts": 256, "k": 8, "nodes": 8, **bad}
    with pytest.raises(ValueError):
        moe.offnode_copies(**args)


def test_active_and_total_parameters_of_mixtral() -> None:
    row = moe.parameter_rows(["mixtral-8x7b"])[0]
    assert row["total"] / 1e9 == pytest.approx(46.7, abs=0.1)  # Jiang et al. 2024, section 2
    assert row["active"] / 1e9 == pytest.approx(12.9, abs=0.1)


def test_ep_divides_memory_and_its_alltoalls_jump_across_nodes() -> None:
    model = replace(Transformer.preset("deepseek-moe-16b"), seq_len=4096)
    plan = Plan(dp=64, micro_batch=1, global_batch=512, zero_stage=1,
                software="megatron-core-te")
    rows = moe.ep_layer_rows(model, dgx_h100(8), plan, [1, 8, 16])
    assert [r.where.split()[0] for r in rows] == ["one", "inside", "across"]
    assert rows[0].memory_bytes > 80e9 > rows[1].memory_bytes > rows[2].memory_bytes
    assert rows[0].alltoall_s == 0.0
    assert rows[2].alltoall_fraction > 2 * rows[1].alltoall_fraction
    assert rows[2].step_overlap_s < rows[2].step_s


def test_the_published_mixtral_run_within_its_band() -> None:
    out = moe.published_mixtral()
    assert abs(out["error"]) < out["result"].band.typical


def test_node_limited_steps_shrink_the_all_to_alls_and_the_step() -> None:
    from dataclasses import replace as swap

    from labsim import Plan, Transformer, dgx_h100
    model = swap(Transformer.preset("deepseek-moe-16b"), seq_len=4096)
    plan = Plan(dp=64, global_batch=512, zero_stage=1, software="megatron-core-te", ep=64)
    rows = moe.node_limited_steps(model, dgx_h100(8), plan, (None, 4))
    assert [r["limit"] for r in rows] == [None, 4]
    assert rows[1]["alltoall_s"] < 0.7 * rows[0]["alltoall_s"]
    assert rows[1]["step_s"] < 0.9 * rows[0]["step_s"]
