"""GPU records: the recording script runs without a GPU and says what it skips; a lab without
a record gets None, and a record is read back with its label."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labsim.experiments import records

from .conftest import ROOT, solution_text


def test_the_recording_script_runs_on_a_cpu_and_says_what_it_skips(tmp_path) -> None:
    run = subprocess.run([sys.executable, "benchmarks/gpu_record.py", "--skip-torchrun"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    if "no CUDA GPU |" in run.stdout:  # this machine has none: everything GPU is skipped
        assert run.stdout.count("skipped") >= 8 and "nothing written" in run.stdout
        assert "no CUDA GPU" in run.stdout


def test_every_section_of_the_recording_script_runs_at_toy_sizes(tmp_path) -> None:
    """``--smoke`` runs each GPU section's code at toy sizes on the CPU, so a typo cannot wait
    for the one run on a GPU; what it writes is labelled and never read as a record."""
    run = subprocess.run([sys.executable, "benchmarks/gpu_record.py", "--smoke",
                          "--skip-torchrun", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(written) == 7, run.stdout
    for name in written:
        doc = json.loads((tmp_path / name).read_text())
        assert doc["status"] == "measured", (name, doc.get("error"), doc.get("traceback"))
        assert doc["environment"]["smoke"] is True


def test_a_smoke_or_failed_file_is_not_a_record(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "labsim" / "data" / "gpu_records"
    folder.mkdir(parents=True)
    (folder / "00_why_gpus.json").write_text(json.dumps(
        {"environment": {"gpu": None, "smoke": True}, "status": "measured"}))
    (folder / "02_mixed_precision.json").write_text(json.dumps(
        {"environment": {"gpu": "NVIDIA H200"}, "status": "failed", "error": "boom"}))
    monkeypatch.setattr(records.resources, "files", lambda _pkg: tmp_path / "labsim")
    assert records.gpu_record("00_why_gpus") is None
    assert records.gpu_record("02_mixed_precision") is None


def test_the_recorded_h200_run_is_shipped_with_the_package() -> None:
    """The run of ``benchmarks/gpu_record.py`` on an H200: every section measured, labelled."""
    for lab in ("00_why_gpus", "02_mixed_precision", "03_checkpointing", "04_flash_attention",
                "05_kernel_fusion", "06_data_loading", "08_data_parallel",
                "12_int8_quantization"):
        rec = records.gpu_record(lab)
        assert rec is not None, lab
        assert rec.environment["gpu"] == "NVIDIA H200" and "smoke" not in rec.environment
        assert rec.label.startswith("recorded on NVIDIA H200 (driver 580.")


def test_a_lab_without_a_record_has_none_and_a_record_reads_back(tmp_path, monkeypatch) -> None:
    assert records.gpu_record("99_no_such_lab") is None
    folder = tmp_path / "labsim" / "data" / "gpu_records"
    folder.mkdir(parents=True)
    (folder / "00_why_gpus.json").write_text(json.dumps({
        "environment": {"gpu": "NVIDIA H200", "driver": "580", "cuda": "13.0",
                        "torch": "2.11.0", "date": "2026-12-01"},
        "status": "measured", "hbm": {"bandwidth_Bps": 4.3e12}}))
    monkeypatch.setattr(records.resources, "files", lambda _pkg: tmp_path / "labsim")
    rec = records.gpu_record("00_why_gpus")
    assert rec.results["hbm"]["bandwidth_Bps"] == 4.3e12
    assert rec.label == ("recorded on NVIDIA H200 (driver 580, CUDA 13.0, torch 2.11.0) "
                         "on 2026-12-01")


# -- the records beside labsim's predictions -------------------------------------------------

TABLES = ("recorded_matmuls", "recorded_layers", "recorded_checkpointing", "recorded_attention",
          "recorded_triton_forward", "recorded_fusion", "recorded_copies", "recorded_nccl_demos",
          "recorded_int8")


def test_every_table_is_labelled_with_the_record_it_shows() -> None:
    for name in TABLES:
        table = getattr(records, name)()
        text = str(table)
        assert "recorded on NVIDIA H200 (driver 580." in text, name
        assert table.rows and all(len(r) == len(table.columns) for r in table.rows), name


def _copy_records(tmp_path, monkeypatch) -> Path:
    """The shipped records in a folder of the test's own, read by ``gpu_record`` instead."""
    folder = tmp_path / "labsim" / "data" / "gpu_records"
    shutil.copytree(ROOT / "labsim" / "data" / "gpu_records", folder)
    monkeypatch.setattr(records.resources, "files", lambda _pkg: tmp_path / "labsim")
    return folder


def test_the_tables_are_computed_from_the_record_not_written_in(tmp_path, monkeypatch) -> None:
    """Change a measurement and the table changes with it; the prediction does not."""
    folder = _copy_records(tmp_path, monkeypatch)
    before = str(records.recorded_matmuls())
    doc = json.loads((folder / "00_why_gpus.json").read_text())
    for row in doc["matmul"]:
        if row["dtype"] == "bf16" and row["n"] == 8192:
            row["flops_per_s"] = 123.4e12
    (folder / "00_why_gpus.json").write_text(json.dumps(doc))
    after = records.recorded_matmuls()
    line = next(r for r in after.rows if r[0] == "bf16 8192^3")
    assert line[1] == "123.4 TFLOP/s" and line[3] == "12%"
    assert line[4] == "792.5 TFLOP/s"  # labsim's GEMM model does not read the record
    assert str(after) != before


def test_the_predictions_are_labsims_own() -> None:
    from labsim.compute import gemm_time, layer_cost
    from labsim.hardware import gpu
    from labsim.quantization import matmul_cost
    from labsim.units import fmt_flops, fmt_time
    from labsim.workload import Transformer

    h200 = gpu("H200")
    line = next(r for r in records.recorded_matmuls().rows if r[0] == "bf16 8192^3")
    assert line[4] == fmt_flops(2 * 8192**3 / gemm_time(8192, 8192, 8192, h200, sustained=1.0))
    layer = next(r for r in records.recorded_layers().rows if r[0].startswith("layer h=12288"))
    cost = layer_cost(Transformer(layers=1, hidden=12288, heads=96, seq_len=2048, vocab=50257,
                                  dropout=False), 1, h200, sustained=1.0)
    assert layer[2] == fmt_time(cost.forward.time_s + cost.backward.time_s)
    int8 = records.recorded_int8().rows[-1]
    assert int8[2] == fmt_time(matmul_cost(h200, 4096, 8192, 8192, dtype="int8").time_s)


def test_a_record_from_an_unknown_gpu_or_none_says_what_to_do(tmp_path, monkeypatch) -> None:
    assert records.catalog_gpu({"gpu": "NVIDIA H200"}).name == "H200"
    with pytest.raises(ValueError, match="labsim.hardware.GPUS"):
        records.catalog_gpu({"gpu": "Imaginary X9"})
    folder = _copy_records(tmp_path, monkeypatch)
    (folder / "12_int8_quantization.json").unlink()
    with pytest.raises(LookupError, match="benchmarks/gpu_record.py"):
        records.recorded_int8()


def test_what_the_labs_say_of_the_record_is_what_the_record_holds() -> None:
    """Each figure a lab quotes from the H200 record, recomputed from the record: a new
    recording fails here until the labs' text is updated with it."""
    r00 = records.gpu_record("00_why_gpus").results
    mm = {(m["dtype"], m["n"]): m["flops_per_s"] for m in r00["matmul"]}
    text00 = solution_text("00_why_gpus.ipynb")
    assert f"**5.4× slower** ({mm['bf16', 4097] / 1e12:.0f}" in text00
    assert round(mm["bf16", 4096] / mm["bf16", 4097], 1) == 5.4
    assert f"8192³ in bf16 ran at {mm['bf16', 8192] / 1e12:.0f} of 989" in text00
    assert f"({r00['hbm']['bandwidth_Bps'] / 1e12:.2f} of 4.8 TB/s" in text00

    r02 = records.gpu_record("02_mixed_precision").results
    text02 = solution_text("02_mixed_precision.ipynb")
    assert f"**{r02['speedup']:.1f}× faster**" in text02
    step = next(r for r in records.recorded_layers().rows if r[0].startswith("same step"))
    predicted_ms = float(step[2].removeprefix("step model ").removesuffix(" ms"))
    assert f"step at {predicted_ms} ms" in text02
    ratio = r02["autocast-bf16"]["step_s"] * 1e3 / predicted_ms
    assert f"**{ratio:.1f}×** that" in text02

    r03 = records.gpu_record("03_checkpointing").results
    ratio = r03["none"]["peak_bytes"] / r03["every layer"]["peak_bytes"]
    assert f"cut the peak {ratio:.1f}×" in solution_text("03_checkpointing.ipynb")

    r04 = records.gpu_record("04_flash_attention").results
    t = {(row["n"], row["kernel"]): row["time_s"] for row in r04["forward_backward"]}
    text04 = solution_text("04_flash_attention.ipynb")
    flash = t[8192, "naive"] / t[8192, "flash"]
    assert f"FlashAttention-2 (SDPA's \"flash\") {flash:.1f}×" in text04
    assert f"cuDNN's kernel is {t[8192, 'naive'] / t[8192, 'cudnn']:.1f}×" in text04

    r05 = records.gpu_record("05_kernel_fusion").results["chain"]
    small, large = r05[0], r05[-1]
    text05 = solution_text("05_kernel_fusion.ipynb")
    graphs = small["eager_queued_s"] / small["graph_replay_queued_s"]
    assert f"**{graphs:.1f}× faster**" in text05
    assert f"**{large['eager_queued_s'] / large['compile_queued_s']:.1f}×**" in text05

    r06 = records.gpu_record("06_data_loading").results
    assert (f"pinned copy ran at {r06['pinned']['bandwidth_Bps'] / 1e9:.0f} GB/s"
            in solution_text("06_data_loading.ipynb"))

    r12 = records.gpu_record("12_int8_quantization").results["int_mm"]
    slow = sorted(1 / row["speedup"] for row in r12)
    assert f"**{slow[0]:.1f}–{slow[-1]:.1f}× slower**" in solution_text(
        "12_int8_quantization.ipynb")

    demos = records.gpu_record("08_data_parallel").results["demos"].values()
    assert all(d["returncode"] == 0 and float(d["result"]) < 1e-12 for d in demos)
