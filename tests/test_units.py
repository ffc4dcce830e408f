"""Units: SI inside, readable text outside, GB vs GiB never mixed."""

from __future__ import annotations

import pytest

from labsim.units import GB, GiB, fmt_bandwidth, fmt_bytes, fmt_flops, fmt_time, parse_bytes


def test_formatting() -> None:
    assert fmt_bytes(80e9) == "80 GB"
    assert fmt_bytes(80e9, binary=True) == "74.5 GiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_flops(312e12) == "312 TFLOP/s"
    assert fmt_flops(989.4e12) == "989.4 TFLOP/s"
    assert fmt_bandwidth(2.039e12) == "2.04 TB/s"


@pytest.mark.parametrize(
    "seconds, text",
    [(4.2e-6, "4.2 µs"), (0.0125, "12.5 ms"), (3.1, "3.1 s"), (9000, "2.5 h"),
     (34 * 86400, "34 days"), (0, "0 s"), (5e-9, "5 ns")],
)
def test_fmt_time(seconds: float, text: str) -> None:
    assert fmt_time(seconds) == text


def test_parse_bytes() -> None:
    assert parse_bytes("1GiB") == GiB
    assert parse_bytes("25 MB") == 25e6
    assert parse_bytes("4096") == 4096
    assert parse_bytes(2.5) == 2.5
    assert parse_bytes("1.5e3 KB") == 1.5e6
    assert GB != GiB


@pytest.mark.parametrize("bad", ["ten GB", "5 parsecs", "", "-1 GB"])
def test_parse_bytes_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_negative_number_rejected() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        parse_bytes(-1)


@pytest.mark.parametrize("dollars, text", [(23594.4, "$23,600"), (4.09625, "$4.10"),
                                           (2089104.9, "$2,090,000"), (0.4, "$0.400"),
                                           (0, "$0"), (-12.5, "-$12.5"), (999.6, "$1,000")])
def test_fmt_usd(dollars: float, text: str) -> None:
    from labsim.units import fmt_usd

    assert fmt_usd(dollars) == text


def test_fmt_energy() -> None:
    from labsim.units import fmt_energy

    assert fmt_energy(3.6e9) == "1 MWh" and fmt_energy(3.6e6 * 70) == "70 kWh"
