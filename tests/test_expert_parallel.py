"""Expert parallelism (labsim.expert_parallel): the plan's rules, the experts' memory and
GEMMs per rank, the all-to-alls in the step on the one network, and the planner's ep axis."""

from __future__ import annotations

import dataclasses

import pytest

import labsim
from labsim import Plan, Transformer, expert_parallel
from labsim.compute import layer_cost, moe_linears
from labsim.memory import stage_params
from labsim.step.costs import step_costs

MIXTRAL = dataclasses.replace(Transformer.preset("mixtral-8x7b"), seq_len=4096)
DEEPSEEK = dataclasses.replace(Transformer.preset("deepseek-moe-16b"), seq_len=4096)
H100 = labsim.dgx_h100(1).gpu


def _plan(**kw: object) -> Plan:
    spec = dict(dp=16, pp=4, micro_batch=1, global_batch=256, zero_stage=1,
                software="megatron-core-te")
    spec.update(kw)
    return Plan(**spec)


@pytest.mark.parametrize("kw, model, fix", [
    (dict(dp=4, ep=8), MIXTRAL, "choose ep dividing dp"),
    (dict(dp=12, ep=3), MIXTRAL, "choose ep among [1, 2, 4, 8]"),
    (dict(dp=8, ep=2), Transformer.preset("gpt3-175b"), "use ep=1"),
    (dict(dp=8, tp=2, ep=2), MIXTRAL, "sequence_parallel=True"),
    (dict(dp=8, ep=2, expert_imbalance=0.9), MIXTRAL, "a number >= 1"),
    (dict(dp=8, ep=2, expert_imbalance=float("nan")), MIXTRAL, "a number >= 1"),
    (dict(dp=8, ep=0), MIXTRAL, "ep"),
])
def test_a_plan_the_experts_cannot_take_is_refused_with_the_fix(kw, model, fix) -> None:
    with pytest.raises(ValueError, match="ep|expert_imbalance") as err:
        Plan(**kw).validate_for(model)
    assert fix in str(err.value)


def test_each_rank_holds_its_share_of_the_experts_and_shards_their_states_over_dp_by_ep():
    per_layer = expert_parallel.routed_expert_params(MIXTRAL, 1, 1)
    assert per_layer == 8 * 3 * 4096 * 14336
    for ep in (2, 4, 8):
        held = stage_params(MIXTRAL, pp=4, ep=ep)
        assert stage_params(MIXTRAL, pp=4) - held == 8 * per_layer * (ep - 1) // ep
    dense_part = stage_params(MIXTRAL, pp=4) - 8 * per_layer
    for ep in (1, 8):
        mem = labsim.estimate_step(MIXTRAL, labsim.dgx_h100(8), _plan(ep=ep)).memory
        experts = 8 * per_layer // ep
        # Adam, fp32 master + two states (12 B) sharded: the rest over 16, experts over 16 / ep
        assert mem.optimizer == pytest.approx(12 * (dense_part / 16 + experts / (16 // ep)))
        assert mem.params == pytest.approx(2 * (dense_part + experts))


def test_expert_parallel_gemms_grow_by_ep_and_the_busiest_rank_sets_the_time() -> None:
    tokens = 4096
    alone = {n: (m, c) for n, m, _, _, c in moe_linears(MIXTRAL, tokens)}
    spread = {n: (m, c) for n, m, _, _, c in moe_linears(MIXTRAL, tokens, ep=8)}
    assert alone["expert_up"] == (tokens * 2 / 8, 8)
    assert spread["expert_up"] == (tokens * 2, 1)  # one expert per rank, every routed row
    base = layer_cost(MIXTRAL, 1, H100, moe=True)
    ep8 = layer_cost(MIXTRAL, 1, H100, moe=True, ep=8)
    busy = layer_cost(MIXTRAL, 1, H100, moe=True, ep=8, expert_imbalance=1.5)
    assert ep8.model_flops == base.model_flops == busy.model_flops
    assert ep8.forward.time_s < base.forward.time_s  # one large GEMM beats eight small ones
    assert busy.forward.time_s > 1.2 * ep8.forward.time_s


def test_dispatch_and_combine_are_two_all_to_alls_each_way_of_every_moe_layer() -> None:
    c = step_costs(MIXTRAL, labsim.dgx_h100(8), _plan(ep=8))
    (a2a,) = c.chunks[0].inline
    assert a2a.placed.cost.op == "alltoall"
    assert a2a.placed.nbytes == 4096 * 2 * 4096 * 2  # tokens x top_k x h x 2 B
    assert (a2a.fwd, a2a.bwd) == (2 * 8, 2 * 8)  # 8 MoE layers a stage
    full = step_costs(MIXTRAL, labsim.dgx_h100(8), _plan(ep=8, recompute="full"))
    (again,) = full.chunks[0].inline
    assert (again.fwd, again.bwd) == (16, 32)  # the recomputed forward's two
    assert full.chunks[0].t_rec > step_costs(
        MIXTRAL, labsim.dgx_h100(8), _plan(recompute="full")).chunks[0].t_rec
    assert step_costs(MIXTRAL, labsim.dgx_h100(8), _plan()).chunks[0].inline == ()
    # the all-to-alls' seconds alone are inside the chunk's work
    assert c.chunks[0].inline_s(True) == pytest.approx(16 * a2a.placed.alone_s)
    leading = step_costs(DEEPSEEK, labsim.dgx_h100(8), _plan(ep=8))
    assert leading.chunks[0].inline[0].fwd == 2 * (7 - 1)  # its first layer is dense


def test_an_all_to_all_that_leaves_the_node_slows_the_step_and_meets_the_buckets() -> None:
    cluster = labsim.dgx_h100(8)
    times = {}
    for ep in (1, 8, 64):
        plan = Plan(dp=64, micro_batch=1, global_batch=512, zero_stage=1,
                    software="megatron-core-te", ep=ep)
        sim = labsim.simulate_step(DEEPSEEK, cluster, plan)
        est = labsim.estimate_step(DEEPSEEK, cluster, plan)
        assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.03)
        times[ep] = sim.step_time_s
    assert times[64] > 1.5 * times[8]  # EP 64 crosses the InfiniBand: all-to-all bound
    c = step_costs(DEEPSEEK, cluster, Plan(dp=64, global_batch=512, ep=64))
    assert c.chunks[0].inline[0].placed.pipes[-2:] == c.buckets[0][0].pipes[-2:]  # the NIC


def test_without_contention_the_engine_and_the_event_free_evaluation_agree_exactly() -> None:
    plan = _plan(ep=8, virtual_stages=8, schedule="interleaved")
    sim = labsim.simulate_step(MIXTRAL, labsim.dgx_h100(8), plan)
    est = labsim.estimate_step(MIXTRAL, labsim.dgx_h100(8), plan)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.005)
    spans = [s for s in sim.trace.spans if s.kind in ("forward", "backward")]
    assert spans  # the all-to-alls run inside the ops' spans


def test_the_planner_searches_ep_and_names_why_it_drops_a_layout() -> None:
    from labsim.sim.plan import candidate_plans, layout_name, plan_search, refusal
    specs = list(candidate_plans(MIXTRAL, labsim.dgx_h100(8), 256, micro_batches=(1,),
                                 zero_stages=(1,), recompute=("none",),
                                 software="megatron-core-te"))
    assert {s["ep"] for s in specs} == {1, 2, 4, 8}
    assert refusal(dict(dp=8, tp=8, ep=2, sequence_parallel=False), MIXTRAL) == \
        "EP with TP but no sequence parallelism"
    assert refusal(dict(dp=8, tp=8, etp=1, sequence_parallel=False), MIXTRAL) == \
        "EP with TP but no sequence parallelism"  # experts folded off the TP grid too
    assert refusal(dict(dp=64, zero_stage=3), MIXTRAL) == \
        "ZeRO-3 with mixture-of-experts layers"
    assert refusal(dict(dp=8, pp=14), dataclasses.replace(DEEPSEEK, dense_layers=3)) == \
        "leading dense layers beyond the first chunk"
    with pytest.raises(ValueError, match="divide"):
        list(candidate_plans(MIXTRAL, labsim.dgx_h100(8), 256, expert_parallel=(3,)))
    found = plan_search(MIXTRAL, labsim.dgx_h100(8), 256, software="megatron-core-te",
                        micro_batches=(1,), zero_stages=(1,), recompute=("none",),
                        max_virtual_stages=8, workers=1, confirm=1)
    layouts = [layout_name(r.plan) for r in found.ranked]
    assert any(" ep8" in x for x in layouts) and "16x1x4 v8 ep8" in layouts


def test_overlapped_all_to_alls_show_only_what_outlasts_a_layer() -> None:
    cluster = labsim.dgx_h100(8)
    with pytest.raises(ValueError, match="set ep > 1"):
        Plan(dp=8, ep_overlap=True)
    times = {}
    for ep, overlap in ((8, False), (8, True), (64, False), (64, True)):
        plan = Plan(dp=64, micro_batch=1, global_batch=512, zero_stage=1,
                    software="megatron-core-te", ep=ep, ep_overlap=overlap)
        inline = step_costs(DEEPSEEK, cluster, plan).chunks[0].inline
        layers = 28 - 1  # MoE layers of the one chunk
        if overlap and ep == 8:  # NVLink all-to-alls hide whole
            assert inline == ()
        elif overlap:  # InfiniBand ones only in part
            assert 0 < inline[0].fwd < 2 * layers
        else:
            assert (inline[0].fwd, inline[0].bwd) == (2 * layers, 2 * layers)
        times[ep, overlap] = labsim.estimate_step(DEEPSEEK, cluster, plan).step_time_s
    assert times[8, True] < times[8, False] and times[64, True] < times[64, False]
    from labsim.sim.plan import candidate_plans
    specs = list(candidate_plans(MIXTRAL, cluster, 256, micro_batches=(1,), zero_stages=(1,),
                                 recompute=("none",), ep_overlap=True))
    assert {(s["ep"] > 1, s.get("ep_overlap", False)) for s in specs} == {
        (True, True), (False, False)}  # a search asked to overlap leaves ep = 1 plans alone


@pytest.mark.parametrize("kw, model, fix", [
    (dict(dp=8, ep=2, capacity_factor=0), MIXTRAL, "a number > 0"),
    (dict(dp=8, ep=2, capacity_factor=float("inf")), MIXTRAL, "None for a dropless MoE"),
    (dict(dp=8, ep=2, capacity_factor="1.25"), MIXTRAL, "a number > 0"),
    (dict(dp=8, ep=2, pad_to_capacity=True), MIXTRAL, "give capacity_factor"),
    (dict(dp=8, ep=2, capacity_factor=1.0, pad_to_capacity=1), MIXTRAL, "True or False"),
    (dict(dp=8, capacity_factor=1.25), Transformer.preset("gpt3-175b"),
     "leave capacity_factor None"),
])
def test_a_capacity_the_experts_cannot_take_is_refused_with_the_fix(kw, model, fix) -> None:
    with pytest.raises(ValueError, match="capacity") as err:
        Plan(**kw).validate_for(model)
    assert fix in str(err.value)


def test_a_capacity_factor_caps_the_busiest_rank_and_padding_fills_every_one() -> None:
    assert _plan(ep=8, expert_imbalance=1.6).expert_load == 1.6  # dropless
    assert _plan(ep=8, expert_imbalance=1.6, capacity_factor=1.25).expert_load == 1.25
    assert _plan(ep=8, expert_imbalance=1.1, capacity_factor=1.25).expert_load == 1.1
    assert _plan(ep=8, capacity_factor=1.25, pad_to_capacity=True).expert_load == 1.25
    cluster = labsim.dgx_h100(8)

    def priced(**kw: object) -> tuple[float, float, float]:
        plan = _plan(ep=8, **kw)
        c = step_costs(MIXTRAL, cluster, plan)
        r = labsim.estimate_step(MIXTRAL, cluster, plan)
        return c.chunks[0].inline[0].placed.nbytes, r.step_time_s, r.memory.activations

    skewed, capped, at_cap = (priced(expert_imbalance=2.0),
                              priced(expert_imbalance=2.0, capacity_factor=1.25),
                              priced(expert_imbalance=1.25))
    assert capped == at_cap and skewed[1] > capped[1] and skewed[0] > capped[0]
    assert skewed[2] > capped[2]  # fewer routed rows kept for backward
    balanced = priced()
    padded = priced(capacity_factor=1.25, pad_to_capacity=True)
    assert padded == at_cap and padded[1] > balanced[1]  # padding costs a balanced router
    assert priced(capacity_factor=1.25) == balanced  # dropping costs it nothing


def test_node_limited_dispatch_is_refused_where_it_cannot_route() -> None:
    with pytest.raises(ValueError, match="set ep > 1"):
        Plan(dp=8, ep_node_limit=4)
    with pytest.raises(ValueError, match="ep_node_limit=0: must be a whole number"):
        Plan(dp=8, ep=8, ep_node_limit=0)
    plan = Plan(dp=64, tp=2, sequence_parallel=True, global_batch=512, ep=64, ep_node_limit=1)
    with pytest.raises(ValueError, match="raise ep_node_limit to at least 2"):
        step_costs(DEEPSEEK, labsim.dgx_h100(16), plan)  # 4 experts a node, 6 a token


def test_node_limited_dispatch_crosses_infiniband_once_per_node_it_needs() -> None:
    from labsim.expert_parallel import offnode_copies
    cluster = labsim.dgx_h100(8)

    def dispatch(ep: int, limit: int | None) -> tuple[object, float]:
        plan = Plan(dp=64, global_batch=512, zero_stage=1, software="megatron-core-te", ep=ep,
                    ep_node_limit=limit)
        placed = step_costs(DEEPSEEK, cluster, plan).chunks[0].inline[0].placed
        sim = labsim.simulate_step(DEEPSEEK, cluster, plan).step_time_s
        assert labsim.estimate_step(DEEPSEEK, cluster, plan).step_time_s == pytest.approx(
            sim, rel=0.03)
        return placed, sim

    inside, _ = dispatch(8, None)
    assert dispatch(8, 1)[0] == inside  # one node: nothing to limit
    plain, t_plain = dispatch(64, None)
    times = [t_plain]
    for limit in (8, 4, 2):
        placed, t = dispatch(64, limit)
        # 64 experts on 8 nodes, 6 a token: InfiniBand copies as DeepSeek-V3 counts them
        assert placed.cost.nic_load / plain.cost.nic_load == pytest.approx(
            offnode_copies(64, 6, 8, limit) / (6 * 7 / 8))
        assert placed.cost.intra_load == pytest.approx(7 / 64 + 56 / 64 * 7 / 8)  # forwards
        times.append(t)
    assert times == sorted(times, reverse=True) and times[-1] < 0.8 * t_plain


def test_a_grouped_gemm_prices_the_local_experts_at_their_total_size() -> None:
    with pytest.raises(ValueError, match="moe_grouped_gemm='yes': must be True or False"):
        Plan(moe_grouped_gemm="yes")
    seq = {ep: layer_cost(DEEPSEEK, 1, H100, moe=True, ep=ep) for ep in (1, 8, 64)}
    grouped = {ep: layer_cost(DEEPSEEK, 1, H100, moe=True, ep=ep, grouped_gemm=True)
               for ep in (1, 8, 64)}
    # one expert a rank (EP 64): nothing to group; 64 or 8 local experts: one kernel each
    assert grouped[64] == seq[64]
    assert grouped[1].forward.time_s == pytest.approx(seq[64].forward.time_s)
    assert grouped[1].forward.time_s < 0.95 * seq[1].forward.time_s
    assert all(grouped[ep].model_flops == seq[ep].model_flops for ep in seq)
    cluster = labsim.dgx_h100(8)
    steps = [labsim.estimate_step(DEEPSEEK, cluster, Plan(
        dp=64, global_batch=512, zero_stage=1, software="megatron-core-te", ep=8,
        moe_grouped_gemm=g)).step_time_s for g in (False, True)]
    assert steps[1] < steps[0]


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_ranks_only() -> None:
    cluster = labsim.dgx_h100(8)

    def carried(model: Transformer, plan: Plan) -> float:  # bytes a chunk's buckets carry
        bucket, count = step_costs(model, cluster, plan).buckets[0]
        return bucket.nbytes * count

    every = 8 * expert_parallel.routed_expert_params(MIXTRAL)  # a chunk's 8 MoE layers
    full = step_costs(MIXTRAL, cluster, _plan()).chunks[0].params
    assert carried(MIXTRAL, _plan()) == pytest.approx(2 * full, rel=1e-6)  # bf16 gradients
    # EP 8: one expert a rank, reduced over its dp / ep = 2 ranks (one a node, on InfiniBand:
    # dearer a byte than the 16-rank ring, mostly NVLink), far fewer bytes than every expert
    assert 2 * (full - every) < carried(MIXTRAL, _plan(ep=8)) < 0.5 * 2 * full
    assert step_costs(MIXTRAL, cluster, _plan(ep=8)).chunks[0].params == full  # optimizer
    # EP 64 over DP 64: every rank alone with its experts, only the rest is reduced
    plan = Plan(dp=64, global_batch=512, zero_stage=1, software="megatron-core-te", ep=64)
    dense = (step_costs(DEEPSEEK, cluster, plan).chunks[0].params
             - 27 * expert_parallel.routed_expert_params(DEEPSEEK))
    assert carried(DEEPSEEK, plan) == pytest.approx(2 * dense, rel=1e-6)


def test_expert_tensor_parallelism_folds_the_experts_onto_their_own_grid() -> None:
    cluster = labsim.dgx_h100(8)

    def plan(**kw: object) -> Plan:
        return Plan(dp=8, tp=2, pp=4, sequence_parallel=True, global_batch=256, zero_stage=1,
                    software="megatron-core-te", **kw)

    with pytest.raises(ValueError, match="ep=8 x etp=4 does not divide tp x cp x dp = 16"):
        plan(ep=8, etp=4)
    with pytest.raises(ValueError, match="etp=3 does not divide"):
        plan(ep=1, etp=3).validate_for(MIXTRAL)
    with pytest.raises(ValueError, match="etp=2 is about experts; gpt3-175b is dense"):
        Plan(dp=8, tp=2, etp=2).validate_for(Transformer.preset("gpt3-175b"))
    with pytest.raises(ValueError, match="etp=1 with tp=2 needs sequence_parallel=True"):
        Plan(dp=8, tp=2, pp=4, global_batch=256, etp=1).validate_for(MIXTRAL)
    assert plan(ep=8).expert_tp == 2 and plan(ep=8, etp=1).expert_data_ranks == 2
    folded, plain = plan(ep=8, etp=1), plan(ep=8)
    # EP 8 one GPU apart stays in a node; two apart (etp = tp) it spans two
    groups = [step_costs(MIXTRAL, cluster, p).chunks[0].inline[0].placed.cost.group
              for p in (folded, plain)]
    assert (groups[0].nnodes, groups[1].nnodes) == (1, 2)
    # each rank's one expert whole instead of half of it; the routed rows halve to match
    assert (stage_params(MIXTRAL, tp=2, pp=4, ep=8, etp=1)
            - stage_params(MIXTRAL, tp=2, pp=4, ep=8)) == 8 * MIXTRAL.expert_params // 2
    rows = {n: (m, nn) for n, m, nn, _, _ in moe_linears(MIXTRAL, 4096, tp=2, ep=8, etp=1)}
    assert rows["expert_up"] == (4096 * 2 * 8 / 8 / 2, 2 * 14336)
    assert layer_cost(MIXTRAL, 1, H100, tp=2, moe=True, ep=8, etp=1).model_flops == \
        layer_cost(MIXTRAL, 1, H100, tp=2, moe=True, ep=8).model_flops
    times = [labsim.estimate_step(MIXTRAL, cluster, p).step_time_s for p in (folded, plain)]
    assert times[0] < times[1]
    assert labsim.simulate_step(MIXTRAL, cluster, folded).step_time_s == pytest.approx(
        times[0], rel=0.01)


def test_tensor_parallel_experts_gather_their_routed_rows_over_their_own_group() -> None:
    cluster = labsim.dgx_h100(8)

    def plan(**kw: object) -> Plan:
        return Plan(dp=8, tp=2, pp=4, sequence_parallel=True, global_batch=256, zero_stage=1,
                    software="megatron-core-te", ep=8, **kw)

    split = step_costs(MIXTRAL, cluster, plan()).chunks[0]
    gather, scatter = split.inline[1:]  # after the all-to-all
    assert (gather.placed.cost.op, scatter.placed.cost.op) == ("allgather", "reduce_scatter")
    # the rank's 4096 / 2 tokens, 2 copies each, from both ranks of the group, 2 bytes each
    assert gather.placed.nbytes == 2 * 4096 // 2 * 2 * 4096 * 2
    assert (gather.fwd, gather.bwd) == (8, 8)  # once a MoE layer each way
    assert split.tp_fwd == 8 * 2  # the attention's two; the MLP's are the experts' now
    whole = step_costs(MIXTRAL, cluster, plan(etp=1)).chunks[0]
    assert len(whole.inline) == 1 and whole.tp_fwd == 8 * 2  # experts whole: no gather
    shared = step_costs(DEEPSEEK, cluster, Plan(
        dp=16, tp=2, pp=2, sequence_parallel=True, global_batch=64, ep=8,
        software="megatron-core-te")).chunks[1]
    assert shared.tp_fwd == 14 * 4  # shared experts keep the MLP's TP collectives


def test_alternating_dense_and_moe_layers_are_priced_chunk_by_chunk() -> None:
    from labsim.sim.plan import refusal
    maverick = Transformer.preset("llama4-maverick-17b-128e")
    with pytest.raises(ValueError, match="multiple of 2 layers"):
        Plan(dp=4, pp=16, global_batch=64).validate_for(maverick)
    assert refusal(dict(dp=4, pp=16, global_batch=64), maverick) == \
        "dense and MoE layers alternate across a chunk boundary"
    assert refusal(dict(dp=8, pp=8, global_batch=64), maverick) is None
    cluster = labsim.dgx_h100(8)
    plan = Plan(dp=8, pp=8, ep=8, global_batch=64, zero_stage=1, software="megatron-core-te")
    c = step_costs(maverick, cluster, plan)
    (a2a,) = c.chunks[1].inline
    assert a2a.fwd == 2 * 3  # 6 layers a chunk, 3 of them MoE
    dense = layer_cost(maverick, 1, H100, moe=False, sustained=c.sustained)
    moe = layer_cost(maverick, 1, H100, moe=True, ep=8, sustained=c.sustained)
    alone = 3 * dense.forward.time_s + 3 * moe.forward.time_s + a2a.seconds(True)
    assert alone <= c.chunks[1].t_fwd < 1.05 * alone  # (+ the overlapped gather's slowdown)
