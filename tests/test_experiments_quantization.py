"""Measurement helpers: outlier rescaling preserves the function, sizes and tables add up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labsim.checks.quantization.reference import (
    MinMaxObserver,
    affine_qparams,
    dequantize,
    quantize,
    quantize_model,
)
from labsim.experiments.quantization import (
    accuracy_table,
    checkpoint_nbytes,
    int_mm_table,
    layer_inputs,
    linear_nbytes,
    pytorch_dynamic_int8,
    range_table,
    time_models,
    torchao_int8,
    with_outlier_channel,
)
from labsim.lab.datasets import Split
from labsim.lab.models import mlp as student_mlp


def mlp() -> nn.Sequential:
    return student_mlp(8, 16, 3, depth=2, seed=0)


def test_outlier_channel_keeps_the_function_and_stretches_one_row() -> None:
    model = mlp()
    out = with_outlier_channel(model, layer=0, unit=5, factor=100.0)
    x = torch.randn(64, 8)
    assert torch.allclose(out(x), model(x), rtol=1e-4, atol=1e-5)
    rows = out[0].weight.detach().abs().amax(dim=1)
    assert rows[5].item() == pytest.approx(100 * model[0].weight[5].abs().max().item(), rel=1e-6)
    assert torch.equal(model[0].weight, mlp()[0].weight)  # the original is untouched
    with pytest.raises(ValueError, match="factor"):
        with_outlier_channel(model, factor=-2)
    with pytest.raises(ValueError, match="followed by another Linear"):
        with_outlier_channel(model, layer=4)


def test_sizes() -> None:
    model = mlp()
    qm = quantize_model(model, [torch.randn(16, 8)])
    assert linear_nbytes(model) == 4 * linear_nbytes(qm)
    # a tiny model: torch.save's per-tensor overhead outweighs the 3 bytes saved per weight
    assert checkpoint_nbytes(qm) > checkpoint_nbytes(model)
    big = student_mlp(64, 256, 10, seed=0)
    qbig = quantize_model(big, [torch.randn(16, 64)])
    ratio = checkpoint_nbytes(big) / checkpoint_nbytes(qbig)
    assert 3.0 < ratio < 4.0
    dyn, note = pytorch_dynamic_int8(model)
    assert isinstance(note, str)
    assert torch.allclose(dyn(torch.ones(2, 8)), model(torch.ones(2, 8)), atol=0.05)


def test_tables() -> None:
    model = mlp()
    data = Split(torch.randn(40, 8), torch.randint(0, 3, (40,)))
    table = accuracy_table(model, {"same": model, "skipped": None}, data)
    assert table.column("model") == ["fp32 (baseline)", "same"]
    assert table.column("change (points)") == [0.0, 0.0]
    assert "accuracy %" in repr(table) and "<table>" in table._repr_html_()
    acts = layer_inputs(model, data.x)
    assert set(acts) == {"0", "2", "4"} and acts["2"].min() >= 0  # post-ReLU
    ranges = range_table(acts["2"], acts["2"], {"min/max": MinMaxObserver},
                                 affine_qparams, quantize, dequantize)
    assert ranges.column("test values clipped") == [0.0]


@pytest.mark.slow
def test_timing_table_and_gpu_only_helper() -> None:
    lin = nn.Linear(16, 16)
    threads = torch.get_num_threads()
    table = time_models({"a": lin, "b": None, "c": lin}, (1, 4), 16, repeat=3,
                                threads=1)
    assert torch.get_num_threads() == threads
    assert [r[:2] for r in table.rows] == [("a", 1), ("a", 4), ("c", 1), ("c", 4)]
    assert table.column("speed-up vs first")[:2] == [1.0, 1.0]
    assert all(len(t.times_s) == 3 for b in (1, 4) for t in table.timings[b].values())
    assert table.speedup("a", 4) == (1.0, 1.0, 1.0)
    assert "a and a take the same time" in table.verdict("a", 1)
    assert table.reading("a", 1).startswith("the same within 10 %")
    with pytest.raises(ValueError, match="CUDA"):
        int_mm_table("cpu")
    model, reason = torchao_int8(lin)
    assert (model is None) == (not reason.startswith("torchao "))


def test_speed_readings_name_a_winner_only_when_the_rounds_agree() -> None:
    from labsim.experiments.quantization import SpeedTable
    from labsim.lab.device import Timing

    def table(fast: tuple[float, ...]) -> SpeedTable:
        base = Timing((1.0, 1.0, 1.0, 1.0))
        return SpeedTable(("layer",), (("fp32", 1), ("int8", 1)),
                          timings={1: {"fp32": base, "int8": Timing(fast)}})

    clear = table((0.5, 0.5, 0.4, 0.5))
    assert repr(clear).startswith("layer\n-----")  # shown as the table, like any Table
    assert clear.speedup("int8", 1)[0] == 2.0
    assert clear.reading("int8", 1).startswith("2x (2.00-2.1")
    assert clear.verdict("int8", 1).startswith("int8 is 2.00x faster than fp32")
    noisy = table((0.5, 2.0, 0.5, 2.0))
    assert noisy.reading("int8", 1).startswith("too noisy to tell")
    assert noisy.verdict("int8", 1).startswith("too noisy to tell")


def test_torchaos_import_leaves_no_notice(caplog: pytest.LogCaptureFixture) -> None:
    """torch's pytree notice about torchao's Enum constants is torchao's to fix; any other
    record of that logger still shows."""
    import logging

    from labsim.experiments.quantization import _without_enum_notice

    class Preference(__import__("enum").Enum):
        AUTO = 0

    Preference.__module__ = "torchao.quantization.fake"
    logger = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"), _without_enum_notice():
        logger.warning("%s is an Enum subclass and is now natively supported", Preference)
        logger.warning("%s is an Enum subclass and is now natively supported", int)
    assert [r.getMessage().split()[0] for r in caplog.records] == ["<class"]
