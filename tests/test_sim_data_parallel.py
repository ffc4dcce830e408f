"""Data-parallel studies over simulate_step."""

from __future__ import annotations

import pytest

from labsim import Plan, Transformer, dgx_a100, simulate_step
from labsim.sim.data_parallel import bucket_sweep, dp_scaling, exposed_comm_s, flat_cluster
from labsim.widgets.zero import zero_rows

GPT = Transformer.preset("gpt2-350m")


def test_without_overlap_all_communication_is_exposed() -> None:
    r = simulate_step(GPT, dgx_a100(2), Plan(dp=16, micro_batch=2, overlap_grad_reduce=False))
    assert exposed_comm_s(r) == pytest.approx(r.breakdown["comm"], rel=1e-9)
    on = simulate_step(GPT, dgx_a100(2), Plan(dp=16, micro_batch=2))
    assert 0 < exposed_comm_s(on) < exposed_comm_s(r)


def test_one_gpu_exposes_nothing() -> None:
    one = simulate_step(GPT, flat_cluster("A100-80GB", 1, "nvlink3"), Plan(micro_batch=2))
    assert exposed_comm_s(one) == 0.0


def test_bucket_size_has_a_sweet_spot() -> None:
    rows = bucket_sweep(GPT, dgx_a100(8), Plan(dp=64, micro_batch=2), [1e5, 1e8, 4e9])
    tiny, mid, huge = (r["exposed_s"] for r in rows)
    assert tiny > mid and huge > mid  # latency-bound; nothing left to overlap


def test_scaling_efficiency_nvlink_beats_ib_and_accumulation_helps() -> None:
    counts = (2, 16, 64)
    nv = dp_scaling(GPT, [flat_cluster("A100-80GB", n, "nvlink3") for n in counts])
    ib = dp_scaling(GPT, [flat_cluster("A100-80GB", n, "ib-hdr") for n in counts])
    acc = dp_scaling(GPT, [flat_cluster("A100-80GB", n, "ib-hdr") for n in counts],
                     accumulation=8)
    for a, b, c in zip(nv, ib, acc):
        assert 0 < b["efficiency"] <= a["efficiency"] <= 1 + 1e-9
        assert c["efficiency"] >= b["efficiency"]
    assert ib[-1]["efficiency"] < ib[0]["efficiency"]


def test_zero_paper_worked_example() -> None:
    got = [round(r["total"] / 1e9, 1) for r in zero_rows(7.5e9, 64)]
    assert got == [120.0, 31.4, 16.6, 1.9]
