"""Measurement helpers: outlier rescaling preserves the function, sizes and tables add up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labsim.lab import classify
from labsim.lab import quant_measure as measure
from labsim.lab import quantization as q8


def mlp() -> nn.Sequential:
    return classify.mlp(8, 16, 3, depth=2, seed=0)


def test_outlier_channel_keeps_the_function_and_stretches_one_row() -> None:
    model = mlp()
    out = measure.with_outlier_channel(model, layer=0, unit=5, factor=100.0)
    x = torch.randn(64, 8)
    assert torch.allclose(out(x), model(x), rtol=1e-4, atol=1e-5)
    rows = out[0].weight.detach().abs().amax(dim=1)
    assert rows[5].item() == pytest.approx(100 * model[0].weight[5].abs().max().item(), rel=1e-6)
    assert torch.equal(model[0].weight, mlp()[0].weight)  # the original is untouched
    with pytest.raises(ValueError, match="factor"):
        measure.with_outlier_channel(model, factor=-2)
    with pytest.raises(ValueError, match="followed by another Linear"):
        measure.with_outlier_channel(model, layer=4)


def test_sizes() -> None:
    model = mlp()
    qm = q8.quantize_model(model, [torch.randn(16, 8)])
    assert measure.linear_nbytes(model) == 4 * measure.linear_nbytes(qm)
    # a tiny model: torch.save's per-tensor overhead outweighs the 3 bytes saved per weight
    assert measure.checkpoint_nbytes(qm) > measure.checkpoint_nbytes(model)
    big = classify.mlp(64, 256, 10, seed=0)
    qbig = q8.quantize_model(big, [torch.randn(16, 64)])
    ratio = measure.checkpoint_nbytes(big) / measure.checkpoint_nbytes(qbig)
    assert 3.0 < ratio < 4.0
    dyn, note = measure.pytorch_dynamic_int8(model)
    assert isinstance(note, str)
    assert torch.allclose(dyn(torch.ones(2, 8)), model(torch.ones(2, 8)), atol=0.05)


def test_tables() -> None:
    model = mlp()
    data = classify.Split(torch.randn(40, 8), torch.randint(0, 3, (40,)))
    table = measure.accuracy_table(model, {"same": model, "skipped": None}, data)
    assert table.column("model") == ["fp32 (baseline)", "same"]
    assert table.column("change (points)") == [0.0, 0.0]
    assert "accuracy %" in repr(table) and "<table>" in table._repr_html_()
    acts = measure.layer_inputs(model, data.x)
    assert set(acts) == {"0", "2", "4"} and acts["2"].min() >= 0  # post-ReLU
    ranges = measure.range_table(acts["2"], acts["2"], {"min/max": q8.MinMaxObserver},
                                 q8.affine_qparams, q8.quantize, q8.dequantize)
    assert ranges.column("test values clipped") == [0.0]


def test_timing_table_and_gpu_only_helper() -> None:
    lin = nn.Linear(16, 16)
    threads = torch.get_num_threads()
    table = measure.time_models({"a": lin, "b": None, "c": lin}, (1, 4), 16, repeat=1,
                                threads=1)
    assert torch.get_num_threads() == threads
    assert [r[:2] for r in table.rows] == [("a", 1), ("a", 4), ("c", 1), ("c", 4)]
    assert table.column("speed-up vs first")[:2] == [1.0, 1.0]
    with pytest.raises(ValueError, match="CUDA"):
        measure.int_mm_table("cpu")
    model, reason = measure.torchao_int8(lin)
    assert (model is None) == (not reason.startswith("torchao "))
