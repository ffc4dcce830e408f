"""labsim.checkpointing: FLOP overhead and memory per recompute mode."""

from __future__ import annotations

import pytest

from labsim import Transformer
from labsim.checkpointing import recompute_flops_overhead, recompute_table


def test_full_recompute_is_megatron_96_over_72():
    m = Transformer.preset("gpt3-175b")
    n, h, s, v = m.layers, m.hidden, m.seq_len, m.vocab
    model = 72 * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    hardware = 96 * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))
    assert recompute_flops_overhead(m, "full") == pytest.approx(hardware / model - 1, rel=1e-2)


def test_full_recompute_tends_to_one_third_without_output_layer():
    m = Transformer(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=8)
    assert recompute_flops_overhead(m, "full") == pytest.approx(1 / 3, rel=1e-3)


def test_selective_costs_the_attention_core_only():
    m = Transformer.preset("gpt3-175b")
    sel = recompute_flops_overhead(m, "selective")
    assert 0 < sel < 0.05 < recompute_flops_overhead(m, "full")
    assert recompute_flops_overhead(m, "none") == 0.0
    with pytest.raises(ValueError):
        recompute_flops_overhead(m, "some")


def test_table_orders_memory():
    t = recompute_table(Transformer.preset("gpt3-175b"), micro_batch=1, tp=8)
    assert t["none"][0] > t["selective"][0] > t["full"][0] > 0
