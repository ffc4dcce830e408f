"""labsim.attention: FLOPs, HBM traffic (Dao 2022) and roofline time of attention."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim import attention as am
from labsim.hardware import gpu

STATS = am.STATS_BYTES


def enumerate_tiled_bytes(n: int, d: int, bq: int, bkv: int, e: int, causal: bool,
                          loop_order: str) -> int:
    """Walk the tiled loops block by block and add up every HBM load and store."""
    total = 0
    q_blocks = [(i, min(n, i + bq)) for i in range(0, n, bq)]
    kv_blocks = [(j, min(n, j + bkv)) for j in range(0, n, bkv)]

    def visible(qb: tuple[int, int], kb: tuple[int, int]) -> bool:
        return not causal or kb[0] <= qb[1] - 1  # some key in kb is <= the last query

    if loop_order == "kv_outer":
        for kb in kv_blocks:
            total += 2 * (kb[1] - kb[0]) * d * e  # load K_j, V_j once
            for qb in q_blocks:
                if visible(qb, kb):
                    rows = qb[1] - qb[0]
                    total += rows * d * e * 3 + rows * STATS * 4  # Q, O in; O out; m, l in/out
    else:
        for qb in q_blocks:
            rows = qb[1] - qb[0]
            total += 2 * rows * d * e + rows * STATS  # Q in, O out, log-sum-exp out
            for kb in kv_blocks:
                if visible(qb, kb):
                    total += 2 * (kb[1] - kb[0]) * d * e
    return total


def test_flops_count_both_matmuls() -> None:
    assert am.attention_flops(128, 64) == 4 * 128 * 128 * 64
    assert am.attention_flops(5, 8, causal=True) == 2 * 8 * 5 * 6
    assert am.attention_flops(16, 8, heads=3, batch=2) == 6 * am.attention_flops(16, 8)


def test_standard_traffic_is_algorithm_0() -> None:
    n, d = 1024, 64
    assert am.standard_attention_hbm_bytes(n, d) == (4 * n * d + 4 * n * n) * 2
    assert am.standard_attention_hbm_bytes(n, d, bytes_per_element=4, heads=2) == (
        2 * (4 * n * d + 4 * n * n) * 4
    )
    extra = am.standard_attention_hbm_bytes(n, d, extra_passes=2) - am.standard_attention_hbm_bytes(
        n, d
    )
    assert extra == 2 * 2 * n * n * 2


def test_block_sizes_follow_flash_attention_1() -> None:
    # A100: 192 KB per SM, bf16 -> M = 96,000 elements; Bc = ceil(M / 4d), Br = min(Bc, d)
    assert am.flash_block_sizes(192e3, 64) == (64, 375)
    assert am.flash_block_sizes(192e3, 128) == (128, 188)
    assert am.flash_block_sizes(4 * 64 * 2, 64) == (1, 1)
    with pytest.raises(ValueError, match="one SM"):
        am.flash_block_sizes(100, 64)


@pytest.mark.parametrize("loop_order", am.LOOP_ORDERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "bq", "bkv"), [(1, 4, 4), (37, 8, 16), (64, 16, 16), (100, 64, 7)])
def test_closed_form_equals_walking_the_loops(loop_order: str, causal: bool, n: int, bq: int,
                                              bkv: int) -> None:
    got = am.tiled_attention_hbm_bytes(n, 8, block_q=bq, block_kv=bkv, causal=causal,
                                       loop_order=loop_order)
    assert got == enumerate_tiled_bytes(n, 8, bq, bkv, 2, causal, loop_order)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), bq=st.integers(1, 64), bkv=st.integers(1, 64),
       causal=st.booleans(), loop_order=st.sampled_from(am.LOOP_ORDERS))
def test_closed_form_equals_walking_the_loops_everywhere(n: int, bq: int, bkv: int, causal: bool,
                                                         loop_order: str) -> None:
    got = am.tiled_attention_hbm_bytes(n, 4, block_q=bq, block_kv=bkv, causal=causal,
                                       loop_order=loop_order, bytes_per_element=1)
    assert got == enumerate_tiled_bytes(n, 4, bq, bkv, 1, causal, loop_order)


def test_one_block_reads_everything_once() -> None:
    n, d = 50, 16
    kv = am.tiled_attention_hbm_bytes(n, d, block_q=n, block_kv=n)
    assert kv == 2 * n * d * 2 + n * (3 * d * 2 + 4 * STATS)
    q = am.tiled_attention_hbm_bytes(n, d, block_q=n, block_kv=n, loop_order="q_outer")
    assert q == 4 * n * d * 2 + n * STATS


def test_theorem_2_scaling_n2_d2_over_m() -> None:
    # Tiled traffic / (N^2 d^2 / M) settles to a constant as N grows (Dao 2022, Theorem 2):
    # 3 streams of Q/O per KV block of ~M/(4d) rows -> ~12 elements, plus the fp32 stats.
    d, sram, e = 64, 192e3, 2
    m = sram / e
    ratios = [am.tiled_attention_hbm_bytes(n, d, sram_bytes=sram) / e / (n * n * d * d / m)
              for n in (2**14, 2**15, 2**16)]
    assert ratios[0] == pytest.approx(ratios[-1], rel=0.02)
    assert 12 <= ratios[-1] <= 12 * (1 + 16 / (3 * d * e)) * 1.01


def test_more_sram_never_costs_more_traffic() -> None:
    sizes = [24e3, 48e3, 96e3, 192e3, 384e3]
    traffic = [am.tiled_attention_hbm_bytes(8192, 64, sram_bytes=s) for s in sizes]
    assert traffic == sorted(traffic, reverse=True)
    assert traffic[-1] < am.standard_attention_hbm_bytes(8192, 64) / 7


def test_causal_skips_blocks_above_the_diagonal() -> None:
    full = am.tiled_attention_hbm_bytes(4096, 64, block_q=64, block_kv=64, loop_order="q_outer")
    half = am.tiled_attention_hbm_bytes(4096, 64, block_q=64, block_kv=64, loop_order="q_outer",
                                        causal=True)
    assert 0.5 < half / full < 0.52


def test_roofline_standard_is_memory_bound_and_tiled_is_not_on_a100() -> None:
    std = am.attention_cost("A100-80GB", 2048, 64, method="standard", heads=12, batch=8)
    flash = am.attention_cost("A100-80GB", 2048, 64, method="tiled", sram_bytes=192e3, heads=12,
                              batch=8)
    assert [k.bound for k in std.kernels] == ["memory"] * 3
    assert flash.kernels[0].bound == "compute"
    a100 = gpu("A100-80GB")
    assert flash.time_s == pytest.approx(flash.flops / a100.peak("bf16"))
    assert std.time_s == pytest.approx(std.hbm_bytes / a100.memory_bandwidth_Bps)
    assert std.flops == flash.flops
    assert std.hbm_bytes == am.standard_attention_hbm_bytes(2048, 64, heads=12, batch=8)
    assert std.time_s / flash.time_s > 3


def test_standard_kernels_compute_the_masked_half_too() -> None:
    std = am.attention_cost("H100-SXM", 512, 64, method="standard", causal=True)
    flash = am.attention_cost("H100-SXM", 512, 64, method="tiled", causal=True, sram_bytes=256e3)
    assert std.flops == am.attention_flops(512, 64)
    assert flash.flops == am.attention_flops(512, 64, causal=True)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"method": "fast"}, "method"),
    ({"method": "tiled"}, "sram_bytes"),
])
def test_attention_cost_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        am.attention_cost("A100-80GB", 128, 64, **kwargs)


@pytest.mark.parametrize("bad", [
    {"seq_len": 0}, {"head_dim": -1}, {"block_q": 8}, {"loop_order": "sideways", "sram_bytes": 1e5},
    {},
])
def test_tiled_traffic_rejects_bad_input(bad: dict) -> None:
    kwargs = {"seq_len": 64, "head_dim": 8, **bad}
    with pytest.raises(ValueError):
        am.tiled_attention_hbm_bytes(**kwargs)


def test_cost_repr_names_the_method_and_gpu() -> None:
    text = repr(am.attention_cost("A100-80GB", 256, 64, method="standard"))
    assert "standard on A100-80GB" in text and "FLOP/B" in text
    assert math.isinf(am.KernelCost("x", 1.0, 0.0, 1.0, "compute").intensity)
