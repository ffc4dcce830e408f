"""The labsim command line: help, the catalog listing, exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest


def labsim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labsim", *args], capture_output=True,
                          text=True)


@pytest.mark.slow
def test_no_command_prints_help_and_exits_2() -> None:
    result = labsim()
    assert result.returncode == 2
    assert "release" in result.stdout


@pytest.mark.slow
def test_hardware_lists_every_catalog_entry_with_dense_peaks() -> None:
    result = labsim("hardware", "--sources")
    assert result.returncode == 0
    for name in ("V100-32GB", "A100-80GB", "H100-SXM", "H200", "MI250X", "ib-ndr", "nvlink4"):
        assert name in result.stdout
    assert "989.4 TFLOP/s" in result.stdout  # H100 SXM bf16 dense, not the sparse 1979
    # Omni-Path's NCCL channel rate, measured on Jean Zay; no other link has one
    opa = next(line for line in result.stdout.splitlines() if line.startswith("opa-100 "))
    assert opa.rstrip().endswith("2.54 GB/s")
    ndr = next(line for line in result.stdout.splitlines() if line.startswith("ib-ndr "))
    assert ndr.rstrip().endswith("-")


@pytest.mark.slow
def test_unknown_command_is_an_error() -> None:
    assert labsim("frobnicate").returncode == 2
