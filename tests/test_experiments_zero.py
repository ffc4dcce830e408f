"""Bytes per rank of replicated Adam, ZeRO-1 and FSDP2 on 2 real processes (also checks that
``labsim.lab.memory`` counts a DTensor by its local shard)."""

from __future__ import annotations

import pytest

from labsim.experiments.zero import bytes_worker
from labsim.lab import launch

pytestmark = pytest.mark.multiprocess


def test_bytes_per_rank_follow_the_sharding() -> None:
    ranks = launch(bytes_worker, 2, kwargs={"width": 32, "depth": 3}, timeout_s=180)
    for r in ranks:
        psi = r["FSDP2"].numel
        assert r["replicated Adam"].params == r["ZeRO-1"].params == 4 * psi
        assert r["replicated Adam"].grads == 4 * psi
        assert r["ZeRO-1"].optimizer == 8 * psi // 2  # moments of its shard only
        # FSDP2 shards dim 0 of each tensor: 32 rows and 32 biases split evenly over 2
        assert r["FSDP2"].params == 2 * psi and r["FSDP2"].grads == 2 * psi
        assert 4 * psi <= r["FSDP2"].optimizer <= 4 * psi + 64  # + scalar step counters
