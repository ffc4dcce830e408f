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
