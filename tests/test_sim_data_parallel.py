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


def test_flat_cluster_puts_network_linked_gpus_in_one_gpu_nodes() -> None:
    ib, nv = flat_cluster("A100-80GB", 16, "ib-hdr"), flat_cluster("A100-80GB", 16, "nvlink3")
    assert (ib.nodes, ib.gpus_per_node, ib.inter_node.name) == (16, 1, "ib-hdr")
    assert (nv.nodes, nv.gpus_per_node, nv.intra_node.name) == (1, 16, "nvlink3")


def test_one_large_nvlink_domain_scales_without_a_dip() -> None:
    # NCCL's tuner picks Tree (a chain inside the node) for mid sizes at 128 ranks; its fill
    # is per tree level, so the chain's length does not make 128 GPUs slower than 256; what is
    # lost is the all-reduce slowing the backward it overlaps (Lee et al. 2025)
    rows = dp_scaling(GPT, [flat_cluster("A100-80GB", n, "nvlink3") for n in (64, 128, 256)],
                      micro_batch=4)
    eff = [r["efficiency"] for r in rows]
    assert eff == sorted(eff, reverse=True) and eff[-1] > 0.9


def test_zero_paper_worked_example() -> None:
    got = [round(r["total"] / 1e9, 1) for r in zero_rows(7.5e9, 64)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_a_forced_nccl_algorithm_prices_the_buckets_its_way():
    """``dp_nccl_algo`` is NCCL_ALGO for the data-parallel collectives: at 8 DGX A100 nodes the
    NCCL model's tuner runs a 25 MiB bucket as Tree; forced to Ring the buckets cost what a
    ring costs there, and the step changes with them."""
    from dataclasses import replace

    import labsim
    from labsim.sim.data_parallel import dp_scaling
    from labsim.software import profile

    gpt = labsim.Transformer.preset("gpt2-1.5b")
    picked = labsim.simulate_collective("allreduce", 25 * 2**20, labsim.dgx_a100(8))
    ring = labsim.simulate_collective("allreduce", 25 * 2**20, labsim.dgx_a100(8), "ring")
    assert picked.algorithm == "tree" and ring.algorithm == "ring"
    forced = replace(profile("generic"), dp_nccl_algo="ring")
    auto_eff, ring_eff = (dp_scaling(gpt, [labsim.dgx_a100(8)], micro_batch=4,
                                     software=s)[0]["efficiency"] for s in ("generic", forced))
    assert (ring_eff > auto_eff) == (ring.time_s < picked.time_s)
    with pytest.raises(ValueError, match="dp_nccl_algo"):
        replace(profile("generic"), dp_nccl_algo="butterfly")
