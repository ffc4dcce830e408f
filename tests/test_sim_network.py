"""The network model: weighted max-min fair rates, and flows executed in time."""

import math

import pytest
import simpy

from labsim.network import alone_rate, fair_rates
from labsim.sim.network import Network

INF = math.inf


def run(flows: list[tuple], capacity: list[float]) -> list[float]:
    """Start each (start_s, nbytes, pipes, loads, cap, latency) flow; return its end time."""
    env = simpy.Environment()
    net = Network(env, capacity)
    ends = [0.0] * len(flows)

    def go(i: int, start: float, nbytes: float, pipes: list[int], loads: list[float],
           cap: float, latency: float):
        yield env.timeout(start)
        yield net.flow(nbytes, pipes, loads, cap, latency)
        ends[i] = env.now

    for i, f in enumerate(flows):
        env.process(go(i, *f))
    env.run()
    return ends


def test_fair_rates_two_on_one_pipe_get_half_and_a_bottleneck_freezes_first():
    cap = [10.0, 10.0, 10.0, 4.0]
    # flows 0 and 1 share pipe 0; flow 2 (pipes 2, 3) is limited by the 4.0 pipe
    rates = fair_rates([([0, 1], [1, 1], INF), ([0, 2], [1, 1], INF), ([2, 3], [1, 1], INF)],
                       cap)
    assert rates == pytest.approx([5.0, 5.0, 4.0])
    # opposite directions are separate pipes: no sharing
    assert fair_rates([([0], [1], INF), ([1], [1], INF)], [1.0, 1.0]) == [1.0, 1.0]
    assert fair_rates([], cap) == []


def test_weights_equalise_bytes_on_the_shared_pipe_and_caps_hold():
    # a flow loading 2 wire bytes per payload byte and one loading 1 share pipe 0 (cap 12):
    # equal byte rates of 6 each, so payload rates 3 and 6
    assert fair_rates([([0], [2.0], INF), ([0], [1.0], INF)], [12.0]) == pytest.approx([3, 6])
    # a capped flow frees bandwidth for the other
    assert fair_rates([([0], [1.0], 2.0), ([0], [1.0], INF)], [10.0]) == pytest.approx([2, 8])
    assert fair_rates([([], [], 5.0)], [1.0]) == [5.0]  # no pipe: its cap
    assert alone_rate([0, 1], [1.0, 4.0], INF, [100.0, 100.0]) == 25.0


def test_a_flow_alone_takes_latency_plus_bytes_over_its_rate():
    assert run([(0.0, 100.0, [0], [1.0], INF, 0.5)], [100.0]) == pytest.approx([1.5])
    assert run([(0.0, 100.0, [0], [1.0], 20.0, 0.0)], [100.0]) == pytest.approx([5.0])
    assert run([(0.0, 0.0, [0], [1.0], INF, 0.25)], [100.0]) == pytest.approx([0.25])


def test_two_flows_on_one_pipe_each_get_half():
    assert run([(0, 100.0, [0], [1.0], INF, 0), (0, 100.0, [0], [1.0], INF, 0)],
               [100.0]) == pytest.approx([2.0, 2.0])


def test_a_late_flow_slows_the_first_and_it_speeds_up_when_the_second_ends():
    # flow 0: 100 B alone at 100 B/s from 0; flow 1: 20 B from 0.5 s
    # 0-0.5: flow 0 moves 50; 0.5-0.9: both at 50 B/s, flow 1 done (20 B), flow 0 at 70;
    # then flow 0 alone: 30 B more in 0.3 s
    ends = run([(0, 100.0, [0], [1.0], INF, 0), (0.5, 20.0, [0], [1.0], INF, 0)], [100.0])
    assert ends == pytest.approx([1.2, 0.9])


def test_flows_on_different_pipes_do_not_interact():
    ends = run([(0, 100.0, [0], [1.0], INF, 0), (0, 100.0, [1], [1.0], INF, 0)], [100.0, 50.0])
    assert ends == pytest.approx([1.0, 2.0])


def test_a_chain_of_shared_pipes_rerates_the_whole_component():
    # A on pipes 0-1, B on 1-2, C on 2 (all 10 B/s): pipes 1 and 2 fill at 5 B/s each, so
    # A gets 5 too although pipe 0 has room; C is 5 B, so it ends at 1 s, then B gets 5 of
    # pipe 2 and A, B share pipe 1 at 5 each until A ends at 2 s; B then alone at 10.
    ends = run([(0, 10.0, [0, 1], [1, 1], INF, 0), (0, 15.0, [1, 2], [1, 1], INF, 0),
                (0, 5.0, [2], [1.0], INF, 0)], [10.0, 10.0, 10.0])
    assert ends == pytest.approx([2.0, 2.5, 1.0])


def test_a_network_refuses_a_pipe_without_bandwidth():
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Network(simpy.Environment(), [1.0, 0.0])


def test_a_flow_joining_a_solo_flow_shares_with_it_and_bytes_are_counted():
    # the first flow starts on an idle network (kept off the pipe index until the second
    # comes); the answer is the one of the shared-pipe test above
    import numpy as np

    env = simpy.Environment()
    net = Network(env, [100.0, 100.0])
    ends = {}

    def go(name, start, nbytes, pipes, loads):
        yield env.timeout(start)
        yield net.flow(nbytes, pipes, loads)
        ends[name] = env.now

    env.process(go("solo", 0, 100.0, np.array([0, 1]), np.array([1.0, 1.0])))
    env.process(go("late", 0.5, 20.0, [1], [1.0]))
    env.run()
    assert ends == pytest.approx({"solo": 1.2, "late": 0.9})
    assert net.moved.tolist() == pytest.approx([100.0, 120.0])


def test_a_step_comes_out_the_same_whatever_the_memory_layout() -> None:
    """Flows admitted at the same instant are re-rated in creation order, not in the order of
    their addresses: the spans of a step (ZeRO-3 gathers and reductions end together) are the
    same list, in the same order, however the interpreter's memory was laid out before."""
    import random

    from labsim import Plan, Transformer, dgx_a100, simulate_step

    def spans(junk: int) -> list[str]:
        keep = [object() for _ in range(junk)]
        random.Random(junk).shuffle(keep)
        r = simulate_step(Transformer.preset("megatron-1.7b"), dgx_a100(2),
                          Plan(dp=16, zero_stage=3, micro_batch=1, global_batch=32,
                               software="fsdp"))
        return [repr(s) for s in r.spans]

    first = spans(0)
    assert all(spans(junk) == first for junk in (1, 1000, 77777))
