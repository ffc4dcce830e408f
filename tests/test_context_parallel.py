"""Context parallelism (labsim.context_parallel): the plan's rules, each rank's share of the
work and memory, the ring's sends hidden by attention or not, the all-gather and all-to-all
variants in the step, and the planner's cp axis."""

from __future__ import annotations

import dataclasses

import pytest

import labsim
from labsim import Plan, Transformer, context_parallel
from labsim.compute import layer_cost
from labsim.memory import activation_per_layer
from labsim.step.costs import step_costs

LLAMA = Transformer.preset("llama2-7b")  # 32 heads, 32 KV heads
H100 = labsim.dgx_h100(1).gpu


def _long(seq_len: int) -> Transformer:
    return dataclasses.replace(LLAMA, seq_len=seq_len)


def _plan(cp: int, comm: str = "p2p", **kw: object) -> Plan:
    spec = dict(dp=32 // cp, cp=cp, cp_comm=comm, global_batch=32, zero_stage=1,
                software="megatron-core-te")
    spec.update(kw)
    return Plan(**spec)


@pytest.mark.parametrize("kw, model, fix", [
    (dict(dp=1, cp=3), _long(4096), "choose cp with 2 x cp dividing 4096"),
    (dict(dp=1, cp=2, attention="standard"), _long(4096), "use attention='flash'"),
    (dict(dp=1, tp=8, cp=8, cp_comm="a2a"), _long(4096), "or cp_comm='p2p'"),
    (dict(dp=1, cp=2, cp_comm="ring"), _long(4096), "choose one of"),
])
def test_a_split_the_sequence_cannot_take_is_refused_with_the_fix(kw, model, fix) -> None:
    with pytest.raises(ValueError, match="cp") as err:
        Plan(**kw).validate_for(model)
    assert fix in str(err.value)


def test_the_gpu_count_includes_cp_and_says_so() -> None:
    plan = Plan(dp=4, tp=2, cp=4)
    assert plan.gpus == 32 and plan.gradient_ranks == 16
    with pytest.raises(ValueError, match=r"dp \* tp \* pp \* cp = 4 \* 2 \* 1 \* 4 = 32 .* "
                                         r"change dp to 2"):
        plan.validate_for(_long(4096), 16)


def test_each_rank_does_its_share_of_the_sequence_and_of_attention() -> None:
    model = _long(32768)
    whole = layer_cost(model, 1, H100)
    for cp in (2, 8):
        part = layer_cost(model, 1, H100, cp=cp)
        assert part.model_flops == pytest.approx(whole.model_flops / cp)  # GEMMs and attention
        assert part.tp_bytes == whole.tp_bytes / cp
        assert part.attention_fwd_s > 0 and part.attention_bwd_s > part.attention_fwd_s
    # a ring's kernel sees s / cp blocks; the all-gather's and Ulysses' the whole sequence
    short = layer_cost(_long(2048), 1, H100, cp=4, cp_comm="p2p")
    long = layer_cost(_long(2048), 1, H100, cp=4, cp_comm="all_gather")
    assert short.attention_fwd_s >= long.attention_fwd_s


def test_activations_divide_by_cp_and_states_shard_over_dp_times_cp() -> None:
    model = _long(32768)
    one = activation_per_layer(model, micro_batch=1, attention="flash")
    local = activation_per_layer(context_parallel.local_model(model, 8), micro_batch=1,
                                 attention="flash")
    assert local == pytest.approx(one / 8)
    cluster = labsim.dgx_h100(4)
    mem = {cp: labsim.estimate_step(model, cluster, _plan(cp)).memory for cp in (1, 8)}
    assert mem[8].activations < mem[1].activations / 7
    assert mem[8].optimizer == pytest.approx(mem[1].optimizer)  # over dp * cp = 32 either way


def test_ring_sends_hide_behind_long_attention_and_show_behind_short() -> None:
    cluster = labsim.dgx_h100(4)
    hidden = step_costs(_long(131072), cluster, _plan(8)).chunks[0]
    assert hidden.inline == ()  # inside a node, a 16k-token block's attention outlasts its send
    shown = step_costs(_long(4096), cluster, _plan(8)).chunks[0]
    (fwd, bwd) = shown.inline
    assert fwd.placed.cost.op == bwd.placed.cost.op == "sendrecv"
    assert bwd.placed.nbytes == 2 * fwd.placed.nbytes  # K, V and their gradients
    assert 0 < fwd.fwd <= 7 * 32 and fwd.bwd == 0 and bwd.fwd == 0 < bwd.bwd <= 7 * 32
    kv = context_parallel.kv_block_bytes(_long(4096), 1, 1, 8, 2)
    assert fwd.placed.nbytes == round(kv) == 512 * 2 * 32 * 128 * 2
    # the same ring across nodes (cp 16 > 8 GPUs a node) pays InfiniBand's rate
    across = step_costs(_long(131072), cluster, _plan(16)).chunks[0]
    assert across.inline and across.inline[0].placed.pipes[-1] >= 2  # a NIC pipe
    assert labsim.estimate_step(_long(131072), cluster, _plan(16)).step_time_s > \
        1.3 * labsim.estimate_step(_long(131072), cluster, _plan(8)).step_time_s


def test_all_gather_and_ulysses_are_blocking_collectives_of_every_layer() -> None:
    cluster = labsim.dgx_h100(4)
    gather = step_costs(_long(16384), cluster, _plan(8, "all_gather")).chunks[0].inline
    assert [(x.placed.cost.op, x.fwd, x.bwd) for x in gather] == [
        ("allgather", 32, 32), ("reduce_scatter", 0, 32)]
    kv = context_parallel.kv_block_bytes(_long(16384), 1, 1, 8, 2)
    assert gather[0].placed.nbytes == round(8 * kv)
    a2a = step_costs(_long(16384), cluster, _plan(8, "a2a")).chunks[0].inline
    assert [x.placed.cost.op for x in a2a] == ["alltoall", "alltoall"]
    q = 16384 // 8 * 4096 * 2
    assert (a2a[0].placed.nbytes, a2a[1].placed.nbytes) == (round(q + kv), q)
    full = step_costs(_long(16384), cluster, _plan(8, "a2a", recompute="full")).chunks[0]
    assert full.inline[0].bwd == 64  # the recomputed forward's all-to-alls too


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_both_faces_agree_with_cp(comm: str) -> None:
    cluster = labsim.dgx_h100(4)
    for seq, cp in ((4096, 8), (16384, 16)):
        plan = _plan(cp, comm)
        sim = labsim.simulate_step(_long(seq), cluster, plan)
        est = labsim.estimate_step(_long(seq), cluster, plan)
        assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.02)
        assert sim.tokens_per_s == pytest.approx(32 * seq / sim.step_time_s)
        assert 0 < sim.mfu < sim.hfu + 1e-12 < 1


def test_the_planner_tries_cp_on_long_sequences_and_names_its_refusals() -> None:
    from labsim.sim.plan import candidate_plans, layout_name, refusal
    cluster = labsim.dgx_h100(2)
    narrow = dict(micro_batches=(1,), zero_stages=(1,), recompute=("none",), tp_max=1,
                  max_virtual_stages=1)
    short = {s["cp"] for s in candidate_plans(_long(4096), cluster, 16, **narrow)}
    assert short == {1}
    long = {s["cp"] for s in candidate_plans(_long(32768), cluster, 16, **narrow)}
    assert long == {1, 2, 4, 8, 16}
    asked = list(candidate_plans(_long(4096), cluster, 16, context_parallel=(1, 2),
                                 cp_comm=("p2p", "a2a"), **narrow))
    assert {(s["cp"], s["cp_comm"]) for s in asked} == {(1, "p2p"), (2, "p2p"), (2, "a2a")}
    assert refusal(dict(dp=1, cp=5), _long(32768)) == "2 x cp does not split the sequence"
    assert refusal(dict(dp=1, cp=16, tp=4, cp_comm="a2a"), _long(32768)) == \
        "a2a: cp does not split the heads"
    assert refusal(dict(dp=1, cp=2, attention="standard"), _long(32768)) == \
        "context parallelism without flash attention"
    with pytest.raises(ValueError, match="cp_comm"):
        list(candidate_plans(_long(4096), cluster, 16, cp_comm=("ring",)))
    assert layout_name(Plan(dp=8, tp=8, pp=16, cp=16, cp_comm="all_gather")) == \
        "8x8x16 cp16 all_gather"


def test_the_load_balanced_split_gives_every_rank_equal_causal_work() -> None:
    from labsim.context_parallel import zigzag_chunk_pairs, zigzag_positions
    world, tokens = 4, 6
    held = [zigzag_positions(r, world, tokens) for r in range(world)]
    assert sorted(p for pos in held for p in pos) == list(range(world * tokens))
    assert held[0] == [0, 1, 2, 21, 22, 23]
    c = tokens // 2
    for pos in held:  # chunk pairs on or below the diagonal, counted from the positions
        chunks = sorted({p // c for p in pos})
        assert sum(q + 1 for q in chunks) == zigzag_chunk_pairs(world)
    with pytest.raises(ValueError, match="2 x ranks chunks"):
        zigzag_positions(0, world, 5)
