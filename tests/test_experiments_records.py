"""GPU records: the recording script runs without a GPU and says what it skips; a lab without
a record gets None, and a record is read back with its label."""

from __future__ import annotations

import json
import subprocess
import sys

from labsim.experiments import records

from .conftest import ROOT


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
