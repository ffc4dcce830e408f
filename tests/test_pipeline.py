"""Pipeline schedules as data: op counts, phase structure, in-flight micro-batches,
dependency order, closed forms; and the simulated face (``simulate_pipeline``) against them."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.pipeline import (
    Op,
    bubble_fraction,
    gpipe,
    in_flight_peak,
    interleaved_one_f_one_b,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    pipeline_time,
)
from labsim.sim.pipeline import simulate_pipeline

CASES = [("gpipe", p, m, 1) for p, m in [(1, 1), (2, 3), (4, 8), (4, 2)]] + [
    ("1f1b", p, m, 1) for p, m in [(1, 4), (2, 1), (4, 4), (4, 9), (8, 3)]] + [
    ("interleaved", p, m, v) for p, m, v in [(2, 2, 2), (2, 4, 3), (4, 8, 2), (4, 4, 4)]]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_stage_runs_each_forward_and_backward_once(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    assert len(schedule) == p
    expected = sorted(Op(k, i, c) for k in "FB" for i in range(m) for c in range(v))
    for ops in schedule:
        assert sorted(ops) == expected
        for i, c in itertools.product(range(m), range(v)):  # forward before its backward
            assert ops.index(Op("F", i, c)) < ops.index(Op("B", i, c))


def _list_schedule(schedule, p, v):
    """Dependency-respecting execution without simpy: fails (deadlock) if the order is not
    executable; returns per stage the order in which ops completed."""
    done, pos, n = set(), [0] * p, p * v
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(schedule[s]):
                continue
            op = schedule[s][pos[s]]
            g = op.model_chunk(s, p)
            need = ("F", op.microbatch, g - 1) if op.kind == "F" else ("B", op.microbatch, g + 1)
            if (op.kind == "F" and g == 0) or (op.kind == "B" and g == n - 1) or need in done:
                done.add((op.kind, op.microbatch, g))
                pos[s] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_schedules_are_executable(name, p, m, v):
    _list_schedule(make_schedule(name, p, m, v), p, v)


def test_one_f_one_b_phases():
    schedule = one_f_one_b(4, 6)
    # stage 0: warm-up of p - 1 = 3 forwards, then alternate, then drain
    assert [repr(op) for op in schedule[0]] == (
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split())
    # last stage: no warm-up, strictly one forward then one backward
    assert [repr(op) for op in schedule[3]] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()


def _reference_order(p, m, v):
    """1F1B (v = 1) and interleaved 1F1B written op by op as Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` orders them: a warm-up of forwards, then
    one forward and one backward at a time, then the remaining backwards."""
    total = m * v
    schedule = []
    for s in range(p):
        if v == 1:
            warmup = min(p - s - 1, m)
        else:
            warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        f = [Op("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(total)]
        b = [Op("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v) for k in range(total)]
        ops = f[:warmup]
        for k in range(total - warmup):
            ops += [f[warmup + k], b[k]]
        schedule.append(tuple(ops + b[total - warmup:]))
    return tuple(schedule)


@pytest.mark.parametrize("p, m, v", [(1, 3, 1), (4, 9, 1), (8, 3, 1), (5, 5, 1), (2, 2, 2),
                                     (4, 8, 2), (4, 4, 4), (3, 9, 3)])
def test_stages_run_warm_up_steady_state_and_cool_down(p, m, v):
    schedule = make_schedule("interleaved" if v > 1 else "1f1b", p, m, v)
    assert schedule == _reference_order(p, m, v)
    assert all(type(ops) is tuple and all(type(op) is Op for op in ops) for ops in schedule)


def _torch_interleaved_order(p, m, v):
    """Each rank's (kind, micro-batch, local chunk) as torch.distributed.pipelining's
    ``ScheduleInterleaved1F1B`` plans them (its rounds of p micro-batches, Megatron-LM's order,
    relaxed to m not a multiple of p); None where this torch does not plan them that way."""
    from types import SimpleNamespace

    try:
        from torch.distributed.pipelining.schedules import (
            ScheduleInterleaved1F1B,
            _ComputationType,
        )

        plan_rank = ScheduleInterleaved1F1B._calculate_single_rank_operations
        forward = _ComputationType.FORWARD
    except (ImportError, AttributeError):
        return None
    rounds = max(1, m // p)
    plan = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds,
                           pp_group_size=p, _n_microbatches=m)
    try:  # torch 2.13's planner reads these four attributes; another may not
        return [tuple(("F" if a.computation_type == forward else "B", a.microbatch_index,
                       a.stage_index // p) for a in plan_rank(plan, rank) if a is not None)
                for rank in range(p)]
    except (AttributeError, TypeError):
        return None


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (3, 9, 3), (8, 16, 2),
                                     (16, 32, 8), (2, 2, 2), (4, 4, 4), (16, 16, 8)])
def test_interleaved_order_is_pytorchs_past_one_round(p, m, v):
    """With more than p micro-batches every stage runs PyTorch's interleaved order op for op
    (Llama 3 405B's 16 stages of v = 8 at 32 micro-batches among them).  With exactly p,
    Megatron-LM runs every forward first on every stage (``num_microbatches ==
    pipeline_parallel_size``, until Megatron-Core's tunable schedule of November 2024 dropped
    the case), PyTorch only on the stages whose warm-up takes them all: the first stage (which
    holds the peak activations) runs the same ops, a later one starts its backwards sooner."""
    torch_order = _torch_interleaved_order(p, m, v)
    if torch_order is None:
        pytest.skip("this torch has no ScheduleInterleaved1F1B planner of this shape")
    ours = [tuple((op.kind, op.microbatch, op.chunk) for op in ops)
            for ops in make_schedule("interleaved", p, m, v)]
    if m > p:
        assert ours == torch_order
        return
    assert ours[0] == torch_order[0]
    last = ours[p - 1]
    assert last.index(("B", 0, v - 1)) == m * v  # every forward first
    assert torch_order[p - 1].index(("B", 0, v - 1)) < m * v
    assert sorted(torch_order[p - 1]) == sorted(last)
    # Megatron-Core's tunable order with its default group of p is PyTorch's at m = p too
    grouped = [tuple((op.kind, op.microbatch, op.chunk) for op in ops)
               for ops in make_schedule("interleaved", p, m, v, group=p)]
    assert grouped == torch_order


@pytest.mark.parametrize("p, m, v", [(4, 6, 2), (2, 3, 3), (4, 12, 2), (3, 8, 2)])
def test_a_group_of_more_than_p_is_pytorchs_round(p, m, v):
    """PyTorch splits m micro-batches into max(1, m // p) equal rounds, each its N (m = 6 on
    4 stages: one round of 6, which Megatron-LM's order cannot run at all); labsim's group of
    that N runs the same ops on every stage."""
    rounds = max(1, m // p)
    if m % rounds:
        pytest.skip("PyTorch needs equal rounds")
    torch_order = _torch_interleaved_order(p, m, v)
    if torch_order is None:
        pytest.skip("this torch has no ScheduleInterleaved1F1B planner of this shape")
    ours = [tuple((op.kind, op.microbatch, op.chunk) for op in ops)
            for ops in make_schedule("interleaved", p, m, v, group=m // rounds)]
    assert ours == torch_order


def _megatron_core_order(p, m, v, n):
    """Each stage's ops as Megatron-Core's ``forward_backward_pipelining_with_interleaving``
    runs them (``megatron/core/pipeline_parallel/schedules.py``, August 2026):
    ``get_schedule_table`` (groups of n micro-batches, the last group the rest), the warm-up
    of ``get_pp_rank_microbatches``, then one forward and one backward in turn, the backward
    of virtual micro-batch k running chunk v - 1 - table[k]'s."""
    table = []
    for first in range(0, m, n):
        ids = range(first, m) if first + n >= m else range(first, first + n)
        table.extend((mb, c) for c in range(v) for mb in ids)
    total = m * v
    order = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * n, total)
        ops = [("F", *table[k]) for k in range(warmup)]
        for k in range(total - warmup):
            ops.append(("F", *table[warmup + k]))
            ops.append(("B", table[k][0], v - 1 - table[k][1]))
        ops.extend(("B", table[k][0], v - 1 - table[k][1]) for k in range(total - warmup, total))
        order.append(tuple(ops))
    return order


@pytest.mark.parametrize("p, m, v", [(2, 5, 2), (4, 4, 2), (4, 9, 2), (4, 10, 3), (3, 7, 2),
                                     (8, 16, 2), (16, 32, 8)])
def test_micro_batch_groups_are_megatron_cores(p, m, v):
    """Every group Megatron-Core accepts (p to m, the rest 0 or at least p) runs its order
    (the rest as a last, shorter group, its own example of p = 2, N = 3, m = 5 among them);
    the group of p past one round is Megatron-LM's order."""
    accepted = 0
    for n in range(p, m + 1):
        if 0 < m % n < p:
            continue
        accepted += 1
        ours = [tuple((op.kind, op.microbatch, op.chunk) for op in ops)
                for ops in make_schedule("interleaved", p, m, v, group=n)]
        assert ours == _megatron_core_order(p, m, v, n), n
        for weights in ([0] + [1] * (v - 1), ([3] + [1] * (v - 2) + [2])[:v]):
            assert in_flight_peak("interleaved", p, m, v, weights, group=n) == max_in_flight(
                make_schedule("interleaved", p, m, v, group=n)[0], weights)
        assert in_flight_peak("interleaved", p, m, v, group=n) == max_in_flight(
            make_schedule("interleaved", p, m, v, group=n)[0])
    assert accepted
    if m > p and m % p == 0:
        assert make_schedule("interleaved", p, m, v, group=p) == make_schedule(
            "interleaved", p, m, v)


def test_micro_batch_groups_megatron_core_refuses_are_refused():
    """A group outside [p, m], one leaving a last group of fewer than p, a group that is not
    a whole number, or a group given to a schedule without chunks: each refused by name."""
    from labsim.pipeline import group_problems

    for n, words in ((3, "between p=4 and m=10"), (11, "between p=4 and m=10"),
                     (8, "last group of 2"), (True, "whole number"), (4.0, "whole number")):
        assert words in group_problems(4, 10, n)
        with pytest.raises(ValueError, match=words):
            make_schedule("interleaved", 4, 10, 2, group=n)
        with pytest.raises(ValueError, match=words):
            in_flight_peak("interleaved", 4, 10, 2, group=n)
    assert group_problems(4, 10, 5) == group_problems(4, 10, 6) == ""
    for name in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match="leave it None"):
            make_schedule(name, 4, 8, 1, group=4)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (8, 8), (1, 5)])
def test_in_flight_micro_batches(p, m):
    assert max_in_flight(one_f_one_b(p, m)[0]) == min(p, m)
    assert max_in_flight(gpipe(p, m)[0]) == m
    assert [max_in_flight(ops) for ops in one_f_one_b(p, m)] == [
        min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 3), (8, 2)])
def test_interleaved_in_flight_matches_korthikanti_factor(p, v):
    # stage 0 holds L (1 + (p - 1)/(p v)) layers' worth = (p v + p - 1) chunks of L/(p v)
    ops = interleaved_one_f_one_b(p, 2 * p, v)[0]
    assert max_in_flight(ops) == p * v + p - 1


def test_in_flight_weighted_by_the_layers_of_each_chunk():
    """Llama 3 405B's first stage: 8 chunks of one layer, the first holding only the
    embedding; at its peak it holds 142 + 1 (micro-batch, chunk) activations, 31 of them of
    chunk 0, so 112 layers' worth when chunk 0 weighs nothing."""
    ops = interleaved_one_f_one_b(16, 32, 8)[0]
    assert max_in_flight(ops) == 143 == max_in_flight(ops, [1] * 8)
    assert max_in_flight(ops, [0] + [1] * 7) == 112
    assert max_in_flight(ops, [2] * 8) == 286
    every_forward_first = interleaved_one_f_one_b(16, 16, 8)[0]
    assert max_in_flight(every_forward_first, [0] + [1] * 7) == 16 * 7
    for p, m, v in itertools.product([2, 4, 16], [1, 2, 3, 4, 8, 32], [1, 2, 3, 8]):
        if (v > 1 and m % p) or (v == 1 and p > 16):
            continue
        name = "interleaved" if v > 1 else "1f1b"
        for weights in ([0] + [1] * (v - 1), ([3] + [1] * (v - 2) + [2])[:v], [2] * v):
            ops = make_schedule(name, p, m, v)[0]
            assert in_flight_peak(name, p, m, v, weights) == max_in_flight(ops, weights)
        ops = gpipe(p, m)[0]
        assert in_flight_peak("gpipe", p, m, 1, [2]) == max_in_flight(ops, [2])


def test_interleaved_needs_m_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of p"):
        interleaved_one_f_one_b(4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zero-bubble", 2, 2)


def test_a_schedule_asked_again_is_the_one_built_and_bad_counts_still_fail():
    """``make_schedule`` keeps what it built (a planner asks the same shapes again), by the
    exact types asked: a count that only compares equal to a kept one (2.0, a numpy integer)
    is still checked and refused, and ``clear_cache`` forgets.  A long schedule is not kept
    (memory)."""
    import numpy as np

    from labsim.pipeline import clear_cache

    clear_cache()
    first = make_schedule("interleaved", 2, 4, 2)
    assert make_schedule("interleaved", 2, 4, 2) is first
    assert first == interleaved_one_f_one_b(2, 4, 2)
    assert make_schedule("1f1b", 2, 4, 2) is not make_schedule("1f1b", 2, 4, 1)
    for p in (2.0, np.int64(2), "2"):
        with pytest.raises(ValueError, match="positive integer"):
            make_schedule("interleaved", p, 4, 2)
    with pytest.raises(ValueError, match="multiple of p"):
        make_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zero-bubble", 2, 4)
    clear_cache()
    again = make_schedule("interleaved", 2, 4, 2)
    assert again is not first and again == first
    long = make_schedule("1f1b", 16, 64)  # 2,048 ops: built afresh, not kept
    assert make_schedule("1f1b", 16, 64) is not long and make_schedule("1f1b", 16, 64) == long


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_simulated_pipeline_equals_closed_form(name, p, m, v):
    t_f, t_b = 1.0, 2.0
    r = simulate_pipeline(p, m, t_f, t_b, schedule=name, v=v)
    assert r.step_time_s == pytest.approx(pipeline_time(p, m, t_f, t_b, v), rel=1e-12)
    assert r.bubble_fraction == pytest.approx(bubble_fraction(p, m, v), rel=1e-12)
    assert r.in_flight[0] == max_in_flight(make_schedule(name, p, m, v)[0])


def test_uniform_gpipe_and_1f1b_take_m_plus_p_minus_1_slots():
    for name in ("gpipe", "1f1b"):
        r = simulate_pipeline(4, 8, 0.5, 1.0, schedule=name)
        assert r.step_time_s == pytest.approx((8 + 4 - 1) * 1.5)
        assert r.bubble_fraction == pytest.approx(3 / 11)


def test_interleaving_divides_the_bubble_by_v():
    p, m = 4, 8
    plain = simulate_pipeline(p, m, 1.0, 2.0)
    for v in (2, 4):
        inter = simulate_pipeline(p, m, 1.0, 2.0, schedule="interleaved", v=v)
        bubble_plain = plain.step_time_s - m * 3.0
        assert inter.step_time_s - m * 3.0 == pytest.approx(bubble_plain / v)


def test_p2p_latency_lengthens_the_step_and_trace_has_sends():
    free = simulate_pipeline(4, 4, 1.0, 2.0)
    slow = simulate_pipeline(4, 4, 1.0, 2.0, p2p_s=0.1)
    assert slow.step_time_s > free.step_time_s
    # 3 boundaries x 4 micro-batches x (activation forward + gradient backward)
    assert len(slow.trace.filter(kind="send")) == 3 * 4 * 2
    assert simulate_pipeline(1, 4, 1.0, 2.0).bubble_fraction == 0.0


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), t_f=st.floats(0.1, 5.0),
       ratio=st.floats(0.5, 3.0), name=st.sampled_from(["gpipe", "1f1b"]))
def test_property_simulation_equals_closed_form(p, m, t_f, ratio, name):
    t_b = ratio * t_f
    r = simulate_pipeline(p, m, t_f, t_b, schedule=name)
    assert r.step_time_s == pytest.approx(pipeline_time(p, m, t_f, t_b), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 5), k=st.integers(1, 3), v=st.integers(2, 3))
def test_property_interleaved_closed_form_and_more_microbatches_less_bubble(p, k, v):
    m = k * p
    r = simulate_pipeline(p, m, 1.0, 2.0, schedule="interleaved", v=v)
    assert r.step_time_s == pytest.approx(pipeline_time(p, m, 1.0, 2.0, v), rel=1e-9)
    more = simulate_pipeline(p, m + p, 1.0, 2.0, schedule="interleaved", v=v)
    assert more.bubble_fraction < r.bubble_fraction


def test_llama3_405b_balances_its_ends_by_counting_the_embedding_and_loss_as_layers():
    """Lab 11 section 11: the published layout against 128 layers split evenly (1.6 % more
    work, 7 % more time: the last stage's output layer and loss on top of 8 layers), and the
    first stage lighter by its embedding-only chunk's activations."""
    from labsim.sim.pipeline import balanced_ends

    measured_s, published, even = balanced_ends()
    assert published.chunk_layers == (0,) + (1,) * 126 + (0,)
    assert even.chunk_layers == (1,) * 128
    assert even.model_flops / published.model_flops == pytest.approx(1.016, abs=0.002)
    assert published.busiest_stage_s < even.busiest_stage_s
    assert even.step_s > 1.05 * published.step_s and even.bubble > published.bubble
    assert even.memory_bytes - published.memory_bytes > 20e9
    assert published.step_s == pytest.approx(measured_s, rel=0.03)
    with pytest.raises(ValueError, match="counts the embedding as a layer"):
        balanced_ends("narayanan2021_t1_1.7B")


def test_llama3s_groups_trade_hidden_sends_for_activations():
    """Lab 11 section 11's second table: Megatron-Core accepts two groups for 32 micro-batches
    on 16 stages (every N from 17 to 31 leaves a last group under 16); breadth-first (32) is
    the faster, by under 2 %, and holds twice the layers on stage 0 and far over 80 GB;
    depth-first (16) is the modelled run."""
    from labsim.published import runs
    from labsim.sim.pipeline import group_trade
    from labsim.sim.step import simulate_step

    depth, breadth = group_trade()
    assert (depth.group, breadth.group) == (16, 32)
    assert 0.97 * depth.step_s < breadth.step_s < depth.step_s
    assert breadth.bubble < depth.bubble
    assert (depth.layers_in_flight, breadth.layers_in_flight) == (112, 223)
    assert breadth.memory_bytes > 150e9 and not breadth.fits
    run = next(r for r in runs() if r.id == "meta2024_llama3_405b_8192gpu")
    assert depth.step_s == simulate_step(run.model, run.cluster, run.plan).step_time_s
    with pytest.raises(ValueError, match="interleaved schedule"):
        group_trade("narayanan2021_t1_1.7B")
