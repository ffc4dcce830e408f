"""The 2-D step timed and predicted (labsim.experiments.mesh): the alpha-beta fit recovers
what made its rows; "this machine" is built from the measured figures; the prediction and
its floors add up; and one real run on 4 processes issues the collectives the layout needs."""

from __future__ import annotations

import pytest

from labsim.experiments import mesh as exp
from labsim.workload import Transformer

CFG = Transformer(layers=2, hidden=64, heads=4, seq_len=32, vocab=128, dropout=False)


def _run(**changes: object) -> exp.MeshRun:
    base = dict(dp=2, tp=2, mesh_s=(0.30, 0.32, 0.31), serial_s=(0.20, 0.21, 0.22),
                rank_flops_per_s=20e9, rank_copy_Bps=5e9, solo_flops_per_s=50e9,
                solo_copy_Bps=10e9, alpha_s=100e-6, bandwidth_Bps=1e9,
                allreduce_rows=((4096.0, 2e-4), (1e6, 1.2e-3)),
                comms={"all_reduce": [12, 6_000_000], "all_gather": [5, 7_000_000],
                       "reduce_scatter": [3, 4_000_000]},
                flops_per_rank=2_000_000_000, serial_flops=8_000_000_000)
    base.update(changes)
    return exp.MeshRun(**base)


@pytest.mark.parametrize("p", [2, 4])
def test_the_fit_recovers_alpha_and_bandwidth(p: int) -> None:
    alpha, bandwidth = 150e-6, 2e9
    rows = [(s, 2 * (p - 1) * alpha + 2 * (p - 1) / p * s / bandwidth)
            for s in (4e3, 3e4, 2.6e5, 1e6)]
    a, b = exp.fit_alpha_beta(rows, p)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bandwidth, rel=1e-6)


def test_a_negative_latency_is_refitted_as_bandwidth_only() -> None:
    rows = [(1e3, 0.5e-6), (1e6, 1e-3)]  # the small message faster than the line through 0
    alpha, bandwidth = exp.fit_alpha_beta(rows, 2)
    assert alpha == 0.0 and 1e9 <= bandwidth <= 2e9
    with pytest.raises(ValueError, match="two sizes"):
        exp.fit_alpha_beta(rows[:1])


def test_times_that_fall_with_size_are_latency_alone() -> None:
    """Seen on a busy 2-core machine: 4 KB slower than 1 MB.  The fit must not return a
    negative bandwidth (a Link refuses it and the lab stopped); it says latency alone."""
    rows = [(4e3, 3.9e-3), (3.3e4, 2.1e-3), (2.6e5, 1.6e-3), (1e6, 1.5e-3)]
    alpha, bandwidth = exp.fit_alpha_beta(rows, 2)
    assert bandwidth == float("inf") and 0.5e-3 < alpha < 2e-3


def test_alpha_beta_floor_counts_every_collective_once() -> None:
    run = _run()
    want = (2 * 12 * 100e-6 + 6e6 / 1e9) + (5 * 100e-6 + 0.5 * 7e6 / 1e9) + (
        3 * 100e-6 + 0.5 * 4e6 / 1e9)
    assert exp.alpha_beta_comm_s(run) == pytest.approx(want)
    assert exp.alpha_beta_comm_s(_run(dp=1, tp=4, comms={"all_gather": [5, 10]})) == 0.0


def test_this_machine_is_what_was_measured() -> None:
    ranks, alone = exp.this_machine(_run())
    assert ranks.world_size == 4 and alone.world_size == 1
    assert ranks.gpu.peak("fp32") == 20e9 and alone.gpu.peak("fp32") == 50e9
    assert ranks.gpu.memory_bandwidth_Bps == 5e9
    assert ranks.intra_node.latency_s == 100e-6 and ranks.intra_node.bandwidth_Bps == 1e9


def test_prediction_and_floors_add_up() -> None:
    run = _run()
    pred = exp.predict(CFG, 8, run)
    assert pred.mesh.plan.dp == 2 and pred.mesh.plan.tp == 2 and pred.mesh.plan.zero_stage == 3
    assert pred.serial.plan.dp == pred.serial.plan.tp == 1
    rows = exp.explain(CFG, 8, run, pred)
    assert [r["step"] for r in rows] == ["2x2 mesh", "1 process"]
    for r in rows:
        assert r["error"] == pytest.approx(r["labsim_s"] / r["measured_s"] - 1)
        assert r["rest_s"] == pytest.approx(max(0.0, r["measured_s"] - r["matmul_floor_s"]
                                                - r["alpha_beta_comm_s"]))
        low, high = r["gemm_fractions"]
        assert 0 < low <= high < 1  # a GPU curve's fractions of the measured peak
    assert rows[0]["matmul_floor_s"] == pytest.approx(2e9 / 20e9)
    assert rows[1]["alpha_beta_comm_s"] == 0.0
    assert set(run.timings) == {"2x2 mesh", "1 process"}
    assert run.summary("mesh")[0] == pytest.approx(0.31)


@pytest.mark.multiprocess
def test_a_real_run_issues_the_collectives_of_the_layout() -> None:
    """The library's layout on 4 processes: per step and rank, FSDP's gathers (a block's
    forward and backward, the root's once) and reduce-scatters, tensor parallelism's 2
    all-reduces forward and 4 backward per block (Q, K, V and up each all-reduce their input's
    gradient); a third of the serial matmul FLOPs or less; every figure positive."""
    from labsim.parallel.mesh import parallelize_2d, train_step_2d

    run = exp.time_mesh(parallelize_2d, train_step_2d, CFG, 8, rounds=2, timeout_s=240)
    assert {k: n for k, (n, _) in run.comms.items()} == {
        "all_gather": 5, "all_reduce": 12, "reduce_scatter": 3}
    assert 0 < run.flops_per_rank < run.serial_flops / 3
    assert len(run.mesh_s) == len(run.serial_s) == 2 and min(run.mesh_s + run.serial_s) > 0
    assert run.alpha_s >= 0 and run.bandwidth_Bps > 0 and run.rank_flops_per_s > 0
    assert len(run.allreduce_rows) == len(exp.ALLREDUCE_NUMELS)
