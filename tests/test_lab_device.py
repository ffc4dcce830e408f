"""labsim.lab.device: the queued timer and what the CPU reports about itself."""

from __future__ import annotations

import time

import pytest

from labsim.lab import cpu_bf16_units, cpu_cache_bytes, time_queued
from labsim.lab.device import BF16_CPU_UNITS


def test_time_queued_calls_fn_warmup_plus_calls_times() -> None:
    calls = []
    per_call = time_queued(lambda: calls.append(time.sleep(0.001)), calls=5, warmup=2)
    assert len(calls) == 7
    assert per_call >= 0.001
    with pytest.raises(ValueError, match="calls"):
        time_queued(lambda: None, calls=0)


def test_the_cpu_reports_caches_that_grow_by_level() -> None:
    sizes = [cpu_cache_bytes(level) for level in (1, 2, 3)]
    if None in sizes:
        pytest.skip("this system does not report its caches")
    assert 0 < sizes[0] <= sizes[1] <= sizes[2]
    assert cpu_cache_bytes(9) is None


def test_bf16_units_are_named_or_none() -> None:
    units = cpu_bf16_units()
    assert units is None or set(units) <= set(BF16_CPU_UNITS.values())
