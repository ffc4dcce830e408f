"""The running table of the learner's GPT step: rows persist and are replaced lab by lab, rows
from another device are marked, a missing row says which lab measures it, MFU comes from
counted FLOPs, the H100 column from labsim's step model, and bad input says how to fix it.

Measuring tests shrink the table's model (``tiny``) so that a step takes milliseconds; the
real model is checked by its FLOP count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from labsim.experiments import my_step
from labsim.lab.timing import Comparison, one_thread
from labsim.plan import Plan
from labsim.step import estimate_step
from labsim.workload import Transformer

TINY = Transformer(layers=1, hidden=32, heads=2, seq_len=32, vocab=64, tied_embeddings=True,
                   name="tiny")
FAST = {"rounds": 3, "max_seconds": 0.05, "device": "cpu", "peak_flops": 1e10}


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(my_step, "TABLE_MODEL", TINY)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_the_table_model_is_lab_00s_gpt_and_its_flops_are_counted() -> None:
    cfg = my_step.TABLE_MODEL
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab) == (2, 128, 4, 256, 512)
    assert cfg.params == 495_104
    tokens = my_step.TABLE_BATCH * cfg.seq_len
    # FlopCounterMode's count of forward + backward equals Megatron's closed form (both
    # count every score of the causal square)
    with one_thread():
        counted = my_step.count_model_flops()
    assert counted == pytest.approx(cfg.flops_per_token * tokens, rel=1e-12)


@pytest.mark.slow
def test_lab_04s_flash_attention_plugs_into_the_table_model() -> None:
    """The learner's FlashAttention-2 (the solution's) in the real model gives the written-out
    attention's loss and gradients, as ``record("04", attention=...)`` requires."""
    from .solution_cells import exercises

    fa2 = exercises("04_flash_attention")["FlashAttention2"]
    with one_thread():
        plugged = my_step.GPTStep(my_step.TECHNIQUES["your-attention"],
                                  attention=lambda q, k, v: fa2.apply(q, k, v, True))
        base = my_step.GPTStep(my_step.TECHNIQUES["fp32"])
        assert plugged.probe() == pytest.approx(base.probe(), rel=1e-5)


def test_the_compile_estimate_uses_lab_05s_chain_bytes() -> None:
    from labsim.fusion import BIAS_GELU_DROPOUT_RESIDUAL, chain_bytes

    sizes = {"x": 4, "bias": 0, "keep": 1, "residual": 4, "t1": 4, "t2": 4, "t3": 4, "t4": 4,
             "y": 4}
    assert chain_bytes(BIAS_GELU_DROPOUT_RESIDUAL, 1, sizes, fused=False) == \
        my_step.EAGER_BYTES_PER_ELEMENT
    assert chain_bytes(BIAS_GELU_DROPOUT_RESIDUAL, 1, sizes, fused=True) == \
        my_step.FUSED_BYTES_PER_ELEMENT


# ------------------------------------------------------------------------- the H100 column


def test_the_h100_column_is_labsims_step_model() -> None:
    col = my_step.h100_column()
    cluster = my_step.one_h100()
    assert cluster.world_size == 1 and cluster.gpu.name == "H100-SXM"
    steps = {key: estimate_step(my_step.H100_MODEL, cluster,
                                Plan(micro_batch=my_step.H100_MICRO_BATCH, **plan))
             for key, plan in my_step.H100_PLANS.items()}
    for key, res in steps.items():
        assert col[key].step_s == res.step_time_s
        assert col[key].memory_bytes == res.memory.activations + res.memory.grads
        assert col[key].mfu == res.mfu
    assert col["fp32"].speedup is None
    assert col["bf16"].speedup == steps["fp32"].step_time_s / steps["bf16"].step_time_s > 1
    assert col["sdpa"].speedup == steps["bf16"].step_time_s / steps["sdpa"].step_time_s > 1
    assert col["checkpoint"].speedup < 1  # recomputing costs time ...
    assert col["checkpoint"].memory_bytes < col["bf16"].memory_bytes / 2  # ... and saves memory
    share = my_step.elementwise_share()
    assert 0 < share < 1
    assert col["compile"].estimated and col["compile"].speedup == pytest.approx(1 + (45 / 13 - 1)
                                                                                * share)
    assert col["your-attention"].speedup is None and "not modelled" in col["your-attention"].how


def test_an_unknown_h100_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="no H100 plan"):
        my_step.h100_step("compile")


# ------------------------------------------------------------------------- rows and the file


@pytest.mark.slow
def test_rows_persist_and_each_lab_replaces_its_own(tiny: None, tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    first = my_step.record("00", path=path, **FAST)
    assert path.exists() and first.path == path
    assert set(first.rows) == {"fp32"} and first.rows["fp32"].lab == "00"
    baseline = first.rows["fp32"]
    later = my_step.record("03", path=path, **{**FAST, "peak_flops": None})
    assert set(later.rows) == {"fp32", "checkpoint"}
    assert later.rows["fp32"] == baseline  # lab 00's row stays
    assert later.rows["checkpoint"].vs_fp32 is not None
    # the peak passed in lab 00 serves the later lab
    assert later.rows["checkpoint"].peak_flops == 1e10
    assert "lab 00" in later.peaks[later.device].source
    again = my_step.record("00", path=path, **{**FAST, "rounds": 4, "max_seconds": 60.0})
    assert again.rows["fp32"].rounds == 4 and again.rows["fp32"] != baseline
    reread = my_step.load(path, "cpu")
    assert reread.rows == again.rows
    assert reread.peaks == again.peaks
    assert reread.model_flops == again.model_flops


def test_a_missing_baseline_is_measured_by_the_lab_that_needs_it(tiny: None,
                                                                 tmp_path: Path) -> None:
    table = my_step.record("03", path=tmp_path / "t.json", **FAST)
    assert table.rows["fp32"].lab == "03"
    assert "not measured yet -- run lab 02" in str(table)


def test_missing_rows_say_which_lab_measures_them(tmp_path: Path) -> None:
    table = my_step.load(tmp_path / "none.json", "cpu")
    text = str(table)
    for tech in my_step.TECHNIQUES.values():
        assert f"{tech.label:29} not measured yet -- run lab {tech.lab}" in text
    summary = table.summary()
    assert "not measured yet -- run lab 05" in summary
    assert "H100: 1." in summary  # the H100 column needs no measured row


def test_rows_from_another_device_are_marked(tiny: None, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    my_step.record("03", path=path, **FAST)
    data = json.loads(path.read_text())
    for row in data["rows"]:
        if row["technique"] == "checkpoint":
            row["device"] = "NVIDIA H100 80GB HBM3"
    path.write_text(json.dumps(data))
    table = my_step.load(path, "cpu")
    text = str(table)
    assert "full activation checkpointing *" in text
    assert "* full activation checkpointing: measured on NVIDIA H100 80GB HBM3" in text
    assert "fp32, written-out attention *" not in text
    assert [r["elsewhere"] for r in table.plot_rows()] == [False, True]
    assert "measured on another device" in table.summary()


def test_mfu_comes_from_the_counted_flops(tiny: None, tmp_path: Path) -> None:
    table = my_step.record("00", path=tmp_path / "t.json", **FAST)
    row = table.rows["fp32"]
    counted = my_step.count_model_flops()
    assert row.model_flops == counted == table.model_flops
    assert counted == pytest.approx(TINY.flops_per_token * my_step.TABLE_BATCH * TINY.seq_len)
    assert row.mfu == pytest.approx(counted / row.step_s / 1e10)
    assert row.tokens_per_s == pytest.approx(my_step.TABLE_BATCH * TINY.seq_len / row.step_s)
    assert row.q1_s <= row.step_s <= row.q3_s and row.rounds >= 3
    assert row.peak_bytes > 0


def test_a_peak_is_measured_when_none_was_given(tiny: None, tmp_path: Path) -> None:
    table = my_step.record("00", path=tmp_path / "t.json",
                           **{**FAST, "peak_flops": None})
    peak = table.peaks[table.device]
    assert peak.flops > 1e8 and "measured by the table" in peak.source
    assert table.rows["fp32"].peak_flops == peak.flops


def test_an_unwritable_folder_leaves_the_table_unsaved(tiny: None, tmp_path: Path) -> None:
    path = tmp_path / "no such folder" / "t.json"
    table = my_step.record("00", path=path, **FAST)
    assert "fp32" in table.rows and not path.exists()
    assert any("was not saved" in note for note in table.notes)


def test_a_graded_run_measures_nothing_and_writes_no_file(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from labsim.lab import guard

    monkeypatch.setattr(guard, "active", lambda: object())
    path = tmp_path / "t.json"
    path.write_text("{not json")  # not even read
    table = my_step.record("05", path=path, **FAST)
    assert table.rows == {} and path.read_text() == "{not json"
    assert any("graded run" in note for note in table.notes)


def test_the_table_round_trips_through_json() -> None:
    cmp = Comparison("sdpa", "fp32", 1.4, 1.3, 1.5, 7, 1.1)
    row = my_step.Row("sdpa", "04", "CPU x (1 thread)", 0.1, 0.09, 0.11, 7, 1000, 5120.0,
                      1e9, 1e10, 1.0, cmp, note="n", when="2025-01-01", torch_version="2")
    assert my_step.Row.from_json(json.loads(json.dumps(row.to_json()))) == row


# ------------------------------------------------------------------------- techniques


@pytest.mark.slow
def test_your_attention_is_measured_only_when_it_is_right(tiny: None, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    good = my_step.record("04", path=path, attention=causal, **FAST)
    assert {"sdpa", "your-attention"} <= set(good.rows)

    def not_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    path.unlink()
    wrong = my_step.record("04", path=path, attention=not_causal, **FAST)
    assert "your-attention" not in wrong.rows and "sdpa" in wrong.rows
    assert any("is it causal?" in note for note in wrong.notes)

    def stub(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("write FlashAttention2")

    unfinished = my_step.record("04", path=tmp_path / "u.json", attention=stub, **FAST)
    assert "your-attention" not in unfinished.rows
    assert any("finish the exercise" in note for note in unfinished.notes)
    missing = my_step.record("04", path=tmp_path / "m.json", **FAST)
    assert any("pass attention=" in note for note in missing.notes)


def test_building_a_step_leaves_the_notebooks_random_state_alone(tiny: None) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    my_step.GPTStep(my_step.TECHNIQUES["checkpoint"])
    assert torch.equal(torch.rand(3), expected)


def test_the_plugged_attention_computes_the_written_out_step(tiny: None) -> None:
    base = my_step.GPTStep(my_step.TECHNIQUES["fp32"])
    plugged = my_step.GPTStep(my_step.TECHNIQUES["your-attention"], attention=causal)
    got, want = plugged.probe(), base.probe()
    assert got == pytest.approx(want, rel=1e-5)


def test_bf16_on_a_cpu_without_bf16_units_says_why(tiny: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(my_step, "cpu_bf16_units", lambda: [])
    table = my_step.record("02", path=tmp_path / "t.json", **FAST)
    note = table.rows["bf16"].note
    assert "reports no bf16 unit" in note and "convert every value to fp32" in note
    assert "15x its fp32 rate" in note  # H100 SXM: 989 / 67 TFLOP/s, from the catalog


def test_a_compiled_step_reports_its_first_call(tiny: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[torch.nn.Module] = []

    def fake_compile(model: torch.nn.Module) -> torch.nn.Module:
        compiled.append(model)
        return model

    monkeypatch.setattr(my_step, "_compile", fake_compile)
    table = my_step.record("05", path=tmp_path / "t.json", **FAST)
    row = table.rows["compile"]
    assert len(compiled) == 1 and row.compile_s is not None and row.compile_s > 0
    assert "first call" in str(table) and "first call" in table.summary()


def test_a_compiler_that_fails_leaves_a_note(tiny: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model: torch.nn.Module) -> object:
        def run(*args: object) -> object:
            raise RuntimeError("no C++ compiler found\nmore")
        return run

    monkeypatch.setattr(my_step, "_compile", broken)
    table = my_step.record("05", path=tmp_path / "t.json", **FAST)
    assert "compile" not in table.rows and "fp32" in table.rows
    assert "torch.compile failed here: no C++ compiler found" in table.notes


# ------------------------------------------------------------------------- verdicts in words


def _row_with(cmp: Comparison | None) -> my_step.Row:
    return my_step.Row("sdpa", "04", "dev", 0.1, 0.09, 0.11, 7, 10, 1.0, 1.0, 1.0, 1.0, cmp)


def test_the_comparison_reads_as_the_rounds_allow() -> None:
    faster = Comparison("sdpa", "fp32", 1.42, 1.35, 1.5, 9, 1.1)
    slower = Comparison("fp32", "sdpa", 3.0, 2.9, 3.2, 9, 1.1)
    noisy = Comparison("sdpa", "fp32", 1.05, 0.9, 1.3, 9, 1.1)
    same = Comparison("sdpa", "fp32", 1.02, 0.98, 1.05, 9, 1.1)
    assert my_step._versus(_row_with(faster)) == "1.42x faster (1.35-1.50)"
    assert my_step._versus(_row_with(slower)) == "3.00x slower (2.90-3.20)"
    assert my_step._versus(_row_with(noisy)) == "too noisy to tell: rerun"
    assert my_step._versus(_row_with(same)) == "same time (within 10 %)"
    assert my_step._versus(_row_with(None)) == "--"


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lab": "01"}, "the labs that do are 00, 02, 03, 04, 05"),
    ({"lab": 1}, "the labs that do are"),
    ({"lab": "04", "attention": 3}, r"FlashAttention2\.apply\(q, k, v, True\)"),
    ({"lab": "00", "peak_flops": 0}, "peak_flops=0: must be this device's peak"),
    ({"lab": "00", "peak_flops": math.inf}, "peak_flops=inf"),
    ({"lab": "00", "rounds": 2}, "rounds=2: must be a whole number >= 3"),
    ({"lab": "00", "max_seconds": -1}, "max_seconds=-1"),
])
def test_bad_arguments_name_the_fix(kwargs: dict, match: str, tmp_path: Path) -> None:
    lab = kwargs.pop("lab")
    with pytest.raises(ValueError, match=match):
        my_step.record(lab, path=tmp_path / "t.json", **kwargs)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"format": "something else", "rows": []}),
    json.dumps([1, 2, 3]),
    json.dumps({"format": my_step.FORMAT, "model": {"layers": 12}, "rows": []}),
    json.dumps({"format": my_step.FORMAT, "model": "MODEL", "rows": [{"technique": "magic"}]}),
    json.dumps({"format": my_step.FORMAT, "model": "MODEL", "rows": [{"technique": "fp32"}]}),
    json.dumps({"format": my_step.FORMAT, "model": "MODEL", "peaks": {"x": {"flop": 1}}}),
])
def test_a_file_that_is_not_the_table_says_how_to_start_again(content: str,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "my_gpt_step.json"
    path.write_text(content.replace('"MODEL"', json.dumps(my_step.model_record())))
    with pytest.raises(ValueError, match=r"delete .*my_gpt_step\.json"):
        my_step.load(path, "cpu")


def test_a_row_with_a_broken_number_is_refused(tmp_path: Path) -> None:
    row = _row_with(None).to_json()
    row["step_s"] = -1.0
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": my_step.FORMAT, "model": my_step.model_record(),
                                "rows": [row]}))
    with pytest.raises(ValueError, match="not a finite number >= 0"):
        my_step.load(path, "cpu")


# ------------------------------------------------------------------------- the figure


@pytest.mark.slow
def test_the_figure_draws_every_measured_row(tiny: None, tmp_path: Path) -> None:
    from labsim.plots.my_step import table_figure

    table = my_step.record("03", path=tmp_path / "t.json", **FAST)
    fig = table_figure(table)
    time_ax, memory_ax = fig.axes
    assert len(time_ax.patches) == len(memory_ax.patches) == 2
    assert [t.get_text() for t in time_ax.get_yticklabels()] == [
        "03 fp32, written-out attention", "03 full activation checkpointing"]
    empty = table_figure(my_step.load(tmp_path / "none.json", "cpu"))
    assert "no row measured yet" in [t.get_text() for t in empty.axes[0].texts]
