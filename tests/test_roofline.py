"""Roofline: hand-computed bounds on catalog GPUs and on a measured machine."""

from __future__ import annotations

import pytest

from labsim.roofline import (
    Roofline,
    arithmetic_intensity,
    attainable_flops,
    fraction_of_peak,
    matmul_bytes,
    matmul_flops,
    op_time,
    ridge_point,
)


def test_h100_ridge_and_roofs() -> None:
    assert ridge_point("H100-SXM", "bf16") == pytest.approx(989.4e12 / 3.35e12)
    assert attainable_flops(1.0, "H100-SXM") == 3.35e12  # memory-bound: I * B
    assert attainable_flops(1e6, "H100-SXM") == 989.4e12  # compute-bound: the roof
    assert attainable_flops(0.0, "A100-80GB") == 0.0


def test_op_time_is_the_larger_bound() -> None:
    flops, nbytes = 312e12, 2.039e12  # one second of each on an A100-80GB
    assert op_time(flops, nbytes, "A100-80GB") == pytest.approx(1.0)
    assert op_time(2 * flops, nbytes, "A100-80GB") == pytest.approx(2.0)
    assert op_time(flops, 3 * nbytes, "A100-80GB") == pytest.approx(3.0)


def test_fraction_of_peak() -> None:
    # An fp32 element-wise add: 1 FLOP per 12 bytes on an H100 (bf16 roof).
    f = fraction_of_peak(1, 12, "H100-SXM", "bf16")
    assert f == pytest.approx((3.35e12 / 12) / 989.4e12)
    # a big square bf16 matmul is compute-bound
    n = 8192
    assert fraction_of_peak(matmul_flops(n, n, n), matmul_bytes(n, n, n, 2)) == 1.0
    assert fraction_of_peak(0, 100) == 0.0


def test_measured_machine_roofline() -> None:
    cpu = Roofline("cpu", peak_flops=100e9, bandwidth_Bps=10e9)
    assert cpu.ridge_point == 10
    assert cpu.bound(100, 1) == "compute" and cpu.bound(1, 100) == "memory"
    assert cpu.fraction_of_peak(50, 10) == pytest.approx(0.5)
    assert "ridge 10 FLOP/byte" in repr(cpu)


def test_matmul_counts() -> None:
    assert matmul_flops(2, 3, 4) == 48
    assert matmul_bytes(2, 3, 4, 4) == (8 + 12 + 6) * 4
    assert arithmetic_intensity(48, 104) == pytest.approx(48 / 104)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: Roofline("x", 0, 1), "peak_flops"),
        (lambda: Roofline("x", 1, -1), "bandwidth_Bps"),
        (lambda: Roofline.of("H100-SXM").attainable_flops(-1), "intensity"),
        (lambda: op_time(-1, 1), "flops"),
        (lambda: op_time(0, 0), "flops > 0 or nbytes > 0"),
        (lambda: arithmetic_intensity(1, 0), "nbytes"),
        (lambda: ridge_point("TPU-v4"), "unknown GPU"),
        (lambda: ridge_point("V100-32GB", "bf16"), "no bf16"),
    ],
)
def test_errors(call, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        call()
